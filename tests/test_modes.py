"""The mode registry (flexdemo.modes): every mode declared once, read by everything else.

* checkpoints written before the registry keep their tags (the strings below are what
  flexdemo.titan.checkpoint.format_tag wrote for these settings before the registry and
  flexdemo.run_settings);
* every [flexdemo] key is read by some mode, and each mode's keys exist;
* outside the registry no code branches on a mode's name.
"""

import ast
from dataclasses import fields
from pathlib import Path
from typing import get_args

import pytest

from flexdemo.modes import EVERY_MODE_KEYS, MODES, mode_of
from flexdemo.run_settings import RunSettings
from flexdemo.section import FlexDemo, Mode

ROOT = Path(__file__).resolve().parent.parent / "flexdemo"


@pytest.mark.parametrize("settings, tag", [
    (dict(mode="off"), "mode=off"),
    (dict(mode="demo"), "mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=False"),
    (dict(mode="demo", overlap=True), "mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=True,payload_format=6"),
    (dict(mode="demo", overlap=True, overlap_lookahead=True, index_coding="elias_fano", momentum_dtype="bfloat16"),
     "mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=True,lookahead=True,index_coding=elias_fano,"
     "momentum_dtype=bfloat16,payload_format=6"),
    (dict(mode="demo", topk=16, value_encoding="scaled_sign"),
     "mode=demo,topk=16,chunk=64,value_encoding=scaled_sign,overlap=False"),
    (dict(mode="diloco"), "mode=diloco,outer_momentum=True,outer_value_encoding=fp32"),
    (dict(mode="diloco", outer_momentum=0.0, outer_nesterov=False, outer_value_encoding="bf16"),
     "mode=diloco,outer_momentum=False,outer_value_encoding=bf16"),
    (dict(mode="demo_diloco"), "mode=demo_diloco,outer_momentum=True,outer_value_encoding=fp32,outer_topk=32,outer_chunk=64"),
    (dict(mode="demo_diloco", outer_topk=64, outer_value_encoding="two_bit", outer_transform="none"),
     "mode=demo_diloco,outer_momentum=True,outer_value_encoding=two_bit,outer_topk=64,outer_chunk=64"),
])
def test_checkpoint_tags_are_the_ones_written_before(settings, tag):
    assert RunSettings(FlexDemo(**settings)).checkpoint_tag == tag


def test_the_registry_is_the_modes_and_their_keys_are_the_sections():
    assert tuple(MODES) == get_args(Mode)
    keys = {f.name for f in fields(FlexDemo)}
    read = set(EVERY_MODE_KEYS).union(*(m.reads for m in MODES.values()))
    assert read == keys  # no key that no mode reads, none read that the section lacks
    for m in MODES.values():
        assert set(m.loss_keys) <= {*m.reads, "exchange"} and mode_of(FlexDemo(mode=m.name)) is m
    assert [m.name for m in MODES.values() if m.reference] == ["off"]
    with pytest.raises(ValueError, match="unknown flexdemo mode 'muon'"):
        mode_of(FlexDemo(mode="muon"))


def _mode_name_branches(path: Path) -> list[str]:
    """Comparisons of something's ``.mode`` (or a ``mode`` name) with a literal: a branch on a
    mode's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = any((isinstance(s, ast.Attribute) and s.attr == "mode") or (isinstance(s, ast.Name) and s.id == "mode")
                        for s in sides)
            literal = any(isinstance(s, ast.Constant) and s.value in MODES or
                          isinstance(s, (ast.Tuple, ast.List, ast.Set)) and
                          any(isinstance(e, ast.Constant) and e.value in MODES for e in s.elts) for s in sides)
            if names and literal:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


def test_nothing_outside_the_registry_branches_on_a_modes_name():
    found = [hit for p in sorted(ROOT.rglob("*.py")) if p.name != "modes.py" for hit in _mode_name_branches(p)]
    assert found == []
