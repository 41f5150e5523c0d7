"""Copies between pinned host memory and the GPU on two side streams, so that while the compute
stream encodes one chunk of a host-held momentum the next chunk goes up and the last one comes
down. The host link's two directions have their own lanes and copy engines: on the compute
stream, one after the other, they were half of an 8B step (docs/results.md 8.1).

Ordering, per pass (one select or restore over a bucket): an upload waits for everything the
compute stream has queued (its buffers come from the compute stream's allocator, and the host
tensors' last writer is an earlier pass, finished below); the compute stream waits for the
upload before using it; a download waits for the compute stream, and its sources are freed only
after the compute stream has waited for it; ``finish`` makes the compute stream
wait for the downloads, so after a pass everything is ordered as if the copies
had run on the compute stream itself. Off CUDA the copies simply run in place, in order."""

from __future__ import annotations

import torch

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)


class HostCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.up = torch.cuda.Stream(device)
            self.down = torch.cuda.Stream(device)

    def upload(self, pairs: Pairs):
        """Start the host -> GPU copies; :meth:`wait` on the result before reading them."""
        return self._copy(self.up, pairs) if self.cuda else self._copy_here(pairs)

    def download(self, pairs: Pairs):
        """GPU -> host copies of what the compute stream has queued so far. The caller keeps the
        sources alive until it has :meth:`wait`-ed on the result: they are then freed in the
        compute stream's order. (Not ``record_stream``: the allocator would then reuse a source
        only once the copy is done by the host's clock, and the host runs a whole bucket ahead of
        the GPU, so every chunk would get new memory.)"""
        return self._copy(self.down, pairs) if self.cuda else self._copy_here(pairs)

    def wait(self, copied) -> None:
        """The compute stream waits for an upload or a download."""
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.down)

    def _copy(self, stream: torch.cuda.Stream, pairs: Pairs) -> torch.cuda.Event:
        """The copies on ``stream``, after everything the compute stream has queued."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return stream.record_event()

    @staticmethod
    def _copy_here(pairs: Pairs) -> None:
        for dst, src in pairs:
            dst.copy_(src)
