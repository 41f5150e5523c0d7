"""Every command docs/results.md, docs/planner.md and benchmarks/README.md give (their ```sh blocks)
still parses and starts on today's code: a CPU dry run, no GPU and no training. `bash
benchmarks/gpu.sh SUITE ...` and `bash benchmarks/recipe.sh STAGE ...` name a suite/stage those
scripts have; the benchmark script behind each (runs.py, shaped_link.py, outer_step.py,
elastic_outage.py, any `python3 benchmarks/X.py`) parses its arguments with its own argparse parser
(the script runs up to parse_args and stops there); every torchtitan job a command names ("NAME
CONFIG FLAGS" with --common, recipe.sh's variants) has its config file and passes
scripts/launch.sh's pre-flight config check with those flags. All checks run in one subprocess (one
torch/torchtitan import)."""

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results.md"
# the planner's checks against the runs live on a page of their own; the comparison batches in benchmarks/README.md
PAGES = (PAGE, REPO / "docs" / "planner.md", REPO / "benchmarks" / "README.md")
PLOTS = REPO / "benchmarks" / "plots.sh"  # the page's plots, one plot.py call per line
# The pre-flight module launch.sh runs (`"$PYTHON" -m MODULE CONFIG FLAGS`); read from launch.sh so a
# move of the module follows it. The fallback is the one place to change if launch.sh stops naming it.
PREFLIGHT_FALLBACK = "flexdemo.titan.preflight"
# gpu.sh suites whose command line goes to a script (with the flags gpu.sh itself adds)
SUITE_SCRIPTS = {"runs": ("benchmarks/runs.py", ["--out", "OUT"]),
                 "link": ("benchmarks/shaped_link.py", ["--device", "gpu", "--out", "OUT"]),
                 "outer": ("benchmarks/outer_step.py", []),
                 "elastic": ("benchmarks/elastic_outage.py", ["--out", "OUT", "--work", "WORK"])}
RUNS_SWITCHES = {"--shared-gpu"}  # benchmarks/runs.py's flags that take no value
SMALL_1000 = "--model.flavor small --training.steps 1000 --validation.freq 250 --metrics.log_freq 50"


def preflight_module() -> str:
    m = re.search(r"-m\s+(flexdemo(?:\.\w+)+)\s+\"?\$CONFIG", (REPO / "scripts" / "launch.sh").read_text())
    return m[1] if m else PREFLIGHT_FALLBACK


def page_commands(text: str) -> list[list[str]]:
    """The command lines of the page's ```sh blocks, split as the shell would (comments dropped)."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def meta_commands() -> list[list[str]]:
    """The command lines of the results folders whose commands the page leaves to their meta.json
    ("Commands: `FOLDER/meta.json`"): its "reproduce" list."""
    out = []
    for folder in re.findall(r"Commands: `([\w.-]+)/meta\.json`", PAGE.read_text()):
        lines = json.loads((REPO / "docs" / "results" / folder / "meta.json").read_text())["reproduce"]
        out += [argv for line in lines if (argv := shlex.split(line, comments=True))]
    return out


def plot_commands(text: str) -> list[list[str]]:
    """The plot.py calls of benchmarks/plots.sh (its other lines are the shell's set-up)."""
    return [shlex.split(line) for line in text.splitlines() if line.startswith("python3 benchmarks/plot.py")]


def case_labels(script: Path) -> set[str]:
    return set(re.findall(r"^\s*([\w|]+)\)", script.read_text(), flags=re.M)) - {"*"}


def recipe_variants() -> tuple[dict[str, str], list[str], list[str]]:
    text = (REPO / "benchmarks" / "recipe.sh").read_text()
    variants = dict(re.findall(r'^\s*\[(\w+)\]="([^"]*)"', text, flags=re.M))
    arrays = {k: v.split() for k, v in re.findall(r"^(GRID|DD)=\(([^)]*)\)", text, flags=re.M)}
    return variants, arrays.get("GRID", []), arrays.get("DD", [])


def _value(argv: list[str], flag: str, default: str = "") -> str:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else default


def plan(commands: list[list[str]]) -> tuple[list[str], list[dict], list[dict]]:
    """(problems found without running anything, argparse checks, config checks)."""
    problems, parses, jobs = [], [], []
    variants, grid, dd = recipe_variants()

    def job(where, spec_or_parts, common, nproc=None):
        parts = shlex.split(spec_or_parts) if isinstance(spec_or_parts, str) else spec_or_parts
        if len(parts) < 2:
            problems.append(f"{where}: job spec {parts} is not 'NAME CONFIG FLAGS'")
            return
        config = REPO / "train_configs" / f"{parts[1]}.toml"
        if not config.is_file():
            problems.append(f"{where}: no config {config.relative_to(REPO)}")
            return
        n = nproc or ("4" if parts[1].startswith("gpu_4gpu") else "2")
        flags = [*shlex.split(common), *parts[2:]]
        if not any(j["config"] == str(config) and j["flags"] == flags and j["nproc"] == n for j in jobs):
            jobs.append({"where": where, "config": str(config), "flags": flags, "nproc": n})

    for argv in commands:
        where = " ".join(argv)[:160]
        if argv[0] == "sudo":
            argv = argv[1:]
        env, argv = {}, list(argv)
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        if argv[0] in ("python", "python3") and argv[1:3] == ["-m", preflight_module()]:
            # the launcher's pre-flight on a config: checked as a job of NNODES x NPROC processes
            world = str(int(env.get("NNODES", "1")) * int(env.get("NPROC", "2")))
            job(where, ["preflight", Path(argv[3]).stem, *argv[4:]], "", world)
        elif argv[0] in ("python", "python3"):
            script = REPO / argv[1]
            if not script.is_file():
                problems.append(f"{where}: no script {argv[1]}")
                continue
            parses.append({"where": where, "script": str(script), "argv": argv[2:]})
        elif argv[0] == "bash" and argv[1] == "benchmarks/gpu.sh":
            if argv[2] == "detach":  # detach SUITE ARGS: the suite it starts is checked as if run directly
                argv = argv[:2] + argv[3:]
            suite, rest = argv[2], argv[3:]
            if suite not in case_labels(REPO / argv[1]):
                problems.append(f"{where}: gpu.sh has no suite {suite!r}")
                continue
            if suite in SUITE_SCRIPTS:
                script, added = SUITE_SCRIPTS[suite]
                parses.append({"where": where, "script": str(REPO / script), "argv": [*added, *rest]})
            elif rest and not (suite in ("collect", "watch") and len(rest) == 1 and rest[0].isdigit()):
                problems.append(f"{where}: gpu.sh {suite} takes no arguments here")  # but collect/watch SECONDS
            if suite == "runs":
                common, nproc = _value(rest, "--common"), _value(rest, "--nproc") or None
                i = 0
                while i < len(rest):  # runs.py's flags take a value but its switches; the rest are job specs
                    if rest[i].startswith("--"):
                        i += 1 if rest[i] in RUNS_SWITCHES else 2
                        continue
                    job(where, rest[i], common, nproc)
                    i += 1
        elif argv[0] == "bash" and argv[1] == "benchmarks/recipe.sh":
            stage, rest = argv[2], argv[3:]
            if stage not in case_labels(REPO / argv[1]):
                problems.append(f"{where}: recipe.sh has no stage {stage!r}")
                continue
            names = {"grid": grid, "dd": dd, "pick": rest[1:]}.get(stage, [])
            for n in names:
                if n not in variants:
                    problems.append(f"{where}: recipe.sh has no variant {n!r}")
                else:
                    job(where, f"{n} {variants[n]}", SMALL_1000 + f" --debug.seed {rest[0]}")
            if stage == "1b":
                for spec in rest[1:]:
                    job(where, spec, "--model.flavor 1B --training.steps 1024 --validation.freq 128")
        elif argv[0] == "bash":
            if not (REPO / argv[1]).is_file():
                problems.append(f"{where}: no script {argv[1]}")
        else:
            problems.append(f"{where}: not a command this test knows how to check")
    return problems, parses, jobs


WORKER = textwrap.dedent("""
    import argparse, contextlib, importlib, io, json, os, runpy, signal, sys
    todo = json.load(sys.stdin)
    out = []

    class Parsed(Exception):
        pass

    original, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_then_stop(self, args=None, namespace=None):
        inside.append(1)
        try:
            original(self, args, namespace)  # unknown flags: SystemExit(2)
        finally:
            inside.pop()
        raise Parsed

    def parse_known_then_stop(self, args=None, namespace=None):
        result = original_known(self, args, namespace)
        if inside:
            return result
        raise Parsed

    def too_slow(*_):
        raise TimeoutError("did not reach its argument parsing in 60 s")

    signal.signal(signal.SIGALRM, too_slow)
    argparse.ArgumentParser.parse_args = parse_then_stop
    argparse.ArgumentParser.parse_known_args = parse_known_then_stop
    for p in todo["parses"]:
        sys.argv = [p["script"], *p["argv"]]
        err = io.StringIO()
        signal.alarm(60)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                runpy.run_path(p["script"], run_name="__main__")
            out.append(p["where"] + ": ran to the end without parsing arguments")
        except Parsed:
            pass
        except SystemExit as e:
            if e.code not in (0, None):
                out.append(p["where"] + ": argument error: " + err.getvalue().strip()[-400:])
        except Exception as e:
            out.append(p["where"] + f": {type(e).__name__}: {e}"[:400])
        finally:
            signal.alarm(0)
    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = original, original_known
    pre = importlib.import_module(todo["preflight"]) if todo["jobs"] else None
    for j in todo["jobs"]:
        os.environ["NPROC"] = j["nproc"]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                pre.main([j["config"], *j["flags"]])
        except SystemExit as e:
            if e.code not in (0, None):
                out.append(j["where"] + ": " + os.path.basename(j["config"]) + " " + " ".join(j["flags"])
                           + ": " + err.getvalue().strip()[-400:])
    print(json.dumps(out))
""")


def run_checks(commands: list[list[str]]) -> list[str]:
    problems, parses, jobs = plan(commands)
    todo = {"parses": parses, "jobs": jobs, "preflight": preflight_module()}
    proc = subprocess.run([sys.executable, "-c", WORKER], input=json.dumps(todo), capture_output=True, text=True,
                          cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}",
                                         "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return problems + json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_command_on_the_results_page_parses_on_todays_code():
    commands = [c for page in PAGES for c in page_commands(page.read_text())] + meta_commands()
    assert len(commands) >= 20, "the page's ```sh blocks hold its commands"
    assert len(meta_commands()) >= 18, "the commands of results 10 and 11 (their folders' meta.json)"
    _, parses, jobs = plan(commands)
    assert len(jobs) >= 30 and len(parses) >= 15
    assert run_checks(commands) == []


def test_every_plot_command_parses_and_draws_from_committed_data():
    commands = plot_commands(PLOTS.read_text())
    assert len(commands) >= 7, "plots.sh draws every plot on the page"
    drawn = {Path(_value(argv, "--out")).name for argv in commands}
    shown = set(re.findall(r"\(plots/([\w-]+)/[\w.-]+\.png\)", PAGE.read_text()))
    assert shown <= drawn, f"plots on the page that plots.sh does not draw: {shown - drawn}"
    for argv in commands:
        data = _value(argv, "--csv") or _value(argv, "--frontier") or _value(argv, "--shaped")
        assert data and (REPO / data).exists(), f"{argv[:4]}: no data {data!r}"
    assert run_checks(commands) == []


@pytest.mark.parametrize("line, expect", [
    ('bash benchmarks/gpu.sh runs --common "--model.flavor small" "a gpu_2gpu_no_such_config"', "no config"),
    ('bash benchmarks/gpu.sh runs --common "--model.flavor small" "a gpu_2gpu_flexdemo --flexdemo.no_such_key 1"',
     "no_such_key"),
    ("bash benchmarks/gpu.sh runs --no-such-flag 3 \"a gpu_2gpu_flexdemo\"", "no-such-flag"),
    ("python3 benchmarks/exchange_bytes.py --no-such-flag", "no-such-flag"),
    ("python3 benchmarks/no_such_script.py --x", "no script"),
    ("bash benchmarks/gpu.sh nosuite", "no suite"),
    ('bash benchmarks/gpu.sh detach runs --common "--model.flavor small" "a gpu_2gpu_no_such_config"', "no config"),
    ("bash benchmarks/gpu.sh collect 560 600", "no arguments"),
    ("bash benchmarks/recipe.sh pick 4321 k8 no_such_variant", "no variant"),
])
def test_the_check_fails_on_a_missing_config_script_or_flag(line, expect):
    found = run_checks([shlex.split(line)])
    assert len(found) == 1 and expect in found[0], found
