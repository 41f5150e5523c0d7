"""A checkpoint's payload format (flexdemo.titan.checkpoint): only an exchange in flight (overlap)
holds payload bytes, so only its tag names the format, and a checkpoint whose exchange in flight
is of another format is refused with one line naming both; without overlap the state does not
depend on how many coefficients a block keeps, and a checkpoint of an earlier format loads.

The saved keys are written here by hand (no run): format 5's tags had no payload_format item."""

from types import SimpleNamespace

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from flexdemo.run_settings import RunSettings
from flexdemo.titan import checkpoint
from flexdemo.titan.config import FlexDemo, FlexDemoConfigError
from flexdemo.wire.format import WIRE_FORMAT_VERSION

PATH = "/nowhere/checkpoint/step-4"
FORMAT_5_PLAIN = "mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=False"
FORMAT_5_OVERLAP = "mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=True"


def _tag(cfg) -> str:
    return RunSettings(cfg).checkpoint_tag


def _resume(monkeypatch, saved_tag, cfg):
    key = f"optimizer.flexdemo.format[{saved_tag}].replicas=2.shards=1"
    monkeypatch.setattr(checkpoint, "checkpoint_to_resume", lambda job_config: PATH)
    monkeypatch.setattr(checkpoint, "saved_keys", lambda path: {key, "optimizer.state.w.delta"})
    monkeypatch.setattr(checkpoint, "_check_data_position", lambda *args: None)
    job_config = SimpleNamespace(fault_tolerance=SimpleNamespace(enable=False))
    return checkpoint.plan_resume(job_config, RunSettings(cfg), 2, 1, FlexDemoConfigError)


def test_only_an_overlap_tag_names_the_payload_format():
    assert _tag(FlexDemo(mode="demo")) == FORMAT_5_PLAIN  # as format 5 wrote it
    assert _tag(FlexDemo(mode="demo", overlap=True)) == \
        f"{FORMAT_5_OVERLAP},payload_format={WIRE_FORMAT_VERSION}"
    assert "payload_format" not in _tag(FlexDemo(mode="demo_diloco"))


def test_a_format_5_checkpoint_without_overlap_loads(monkeypatch):
    resume = _resume(monkeypatch, FORMAT_5_PLAIN, FlexDemo(mode="demo"))
    assert resume is not None and resume.path == PATH and (resume.replicas, resume.shards) == (2, 1)


def test_a_format_5_exchange_in_flight_is_refused_naming_the_format(monkeypatch):
    assert WIRE_FORMAT_VERSION == 6
    with pytest.raises(FlexDemoConfigError) as e:
        _resume(monkeypatch, FORMAT_5_OVERLAP, FlexDemo(mode="demo", overlap=True))
    line = str(e.value)
    assert "\n" not in line
    assert "holds an exchange in flight (overlap) in payload format 5 or earlier, this code sends and reads " \
           "format 6" in line, line
    assert "--checkpoint.initial_load_model_only" in line


def test_an_exchange_in_flight_of_this_format_loads(monkeypatch):
    cfg = FlexDemo(mode="demo", overlap=True)
    assert _resume(monkeypatch, _tag(cfg), cfg) is not None


def test_other_settings_beside_the_format_get_the_settings_line(monkeypatch):
    with pytest.raises(FlexDemoConfigError, match=r"was written with \[mode=demo,topk=32,.*overlap=True\], this run "
                                                  r"asks for \[mode=demo,topk=16,"):
        _resume(monkeypatch, FORMAT_5_OVERLAP, FlexDemo(mode="demo", topk=16, overlap=True))
