"""The recommendation: the fastest row that fits and whose held-out loss against AdamW's, measured
on the comparison corpus, has a 95% interval over paired seeds ending at or below +1% (AdamW itself
counts, at 0); rows within 2% of the fastest step time are ranked by that upper end instead (a
faster link then buys nothing)."""

from __future__ import annotations

from flexdemo.modes import mode_of

from .evidence import LOSS_TOLERANCE
from .model import Row, variant_keys

TIE = 1.02  # step times within 2% count as equal


def eligible(row: Row) -> bool:
    if row.fits is False:
        return False
    if mode_of(row.variant).reference:
        return True
    return row.loss is not None and row.loss.within(LOSS_TOLERANCE)


def recommend(rows: list[Row]) -> tuple[Row | None, str]:
    """(the row, ``because ...``) or (None, why none)."""
    ok = [r for r in rows if eligible(r)]
    if not ok:
        return None, "no mode fits this GPU's memory with a held-out loss shown within +1% of AdamW's"
    fastest = min(r.seconds_per_step for r in ok)
    close = [r for r in ok if r.seconds_per_step <= TIE * fastest]
    best = min(close, key=lambda r: (0.0 if mode_of(r.variant).reference else r.loss.interval.high,
                                     r.seconds_per_step))
    adamw = next((r for r in rows if mode_of(r.variant).reference), None)
    if mode_of(best.variant).reference:
        if len(ok) == 1:
            return best, ("no other mode fits with a held-out loss shown within +1% of AdamW's (the 95% interval "
                          "over paired seeds on the comparison corpus)")
        return best, "the link is not the bottleneck: no mode with a loss shown within +1% steps faster"
    speed = ""
    if adamw is not None:
        speed = (f"{best.seconds_per_step:.3f} s/step against AdamW-HSDP's {adamw.seconds_per_step:.3f} "
                 f"({adamw.seconds_per_step / best.seconds_per_step:.1f}x its tokens/s"
                 f"{'' if adamw.fits is not False else '; AdamW-HSDP does not fit'}), ")
    return best, f"{speed}held-out loss {best.loss.text()}"


def how_to_run(row: Row, config: str, job_config) -> str:
    """The config and the flags that turn it into the row (and the preset it copies)."""
    cfg = job_config.flexdemo
    keys = variant_keys(cfg, row.variant)
    flags = [(f"--flexdemo.{k}" if v else f"--flexdemo.no-{k}") if isinstance(v, bool) else f"--flexdemo.{k} {v}"
             for k, v in keys if getattr(cfg, k) != v]
    preset = f"; the keys of train_configs/{row.variant.preset}" if row.variant.preset else ""
    return " ".join([config, *flags]) + preset
