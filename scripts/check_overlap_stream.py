"""GPU check: DeMo(overlap=True) encoding on its own CUDA stream gives the same bits as the
same optimizer encoding on the main stream, while a heavy forward/backward runs beside the
encode and zero_grad frees the gradients it reads.

The semantics of overlap (an explicitly delayed reference) are tested on CPU
(tests/test_optim_overlap.py); what only a GPU can show is that the stream ordering holds:
the encode reads the finished gradients, the momentum is not read before the encode wrote it,
and freed gradients are not reused under it. ``--mutation no-wait`` drops the encode stream's
wait for the main stream, which this check must catch (exit 1).

    python3 scripts/check_overlap_stream.py --steps 30          # exit 0: identical
    python3 scripts/check_overlap_stream.py --mutation no-wait   # exit 1: the check sees it
"""

from __future__ import annotations

import argparse
import sys

import torch

from flexdemo import DeMo


class _NoWaitStream:
    """A stream whose wait_stream does nothing (the mutation): everything else delegates."""

    def __init__(self, stream):
        self._stream = stream

    def wait_stream(self, other) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _model(width: int, depth: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]).cuda()


def _run(args, side_stream: bool, mutation: str | None):
    model = _model(args.width, args.depth, seed=0)
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=32, compression_decay=0.999, weight_decay=0.1,
               value_encoding="sign", overlap=True)
    if not side_stream:
        opt._encode_stream = None  # the same optimizer, encoding on the main stream
    elif mutation == "no-wait":
        opt._encode_stream = _NoWaitStream(opt._encode_stream)
    gen = torch.Generator(device="cuda").manual_seed(1)
    momenta = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, device="cuda", generator=gen)
        loss = model(x).square().mean()
        for _ in range(args.repeat_forward):  # more work beside the encode than its own
            loss = loss + 1e-6 * model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 7 == 6:  # a checkpoint-like read of the momentum mid-run
            momenta.append([s["delta"].clone() for s in opt.state_dict()["state"].values()])
    opt.finish_pending()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], momenta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeat-forward", type=int, default=2)
    ap.add_argument("--mutation", choices=["no-wait"], default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_overlap_stream: needs a CUDA device", file=sys.stderr)
        return 2
    serial, serial_m = _run(args, side_stream=False, mutation=None)
    side, side_m = _run(args, side_stream=True, mutation=args.mutation)
    params_equal = all(torch.equal(a, b) for a, b in zip(serial, side))
    momenta_equal = all(torch.equal(a, b) for xs, ys in zip(serial_m, side_m) for a, b in zip(xs, ys))
    moved = any(not torch.equal(a, b) for a, b in zip(serial, [p.detach() for p in _model(args.width, args.depth, 0)
                                                           .parameters()]))
    print(f"overlap encode stream vs main stream, {args.steps} steps, {args.depth} x [{args.width}]^2"
          f"{' (mutation ' + args.mutation + ')' if args.mutation else ''}: parameters identical {params_equal}, "
          f"momenta at checkpoints identical {momenta_equal}, parameters moved {moved}")
    return 0 if params_equal and momenta_equal and moved else 1


if __name__ == "__main__":
    sys.exit(main())
