"""Sandboxed tools: the Python subprocess's output, errors and limits, the calculator, and their JSON schemas."""
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers.utils import get_json_schema

from grpo_jax.tools.sandbox import calculator, make_python_tool, python


def test_python_returns_what_the_code_prints():
    assert python("print(sum(range(10)))").strip() == "45"
    assert python("print('é✓')").strip() == "é✓"
    assert "print()" in python("x = 6 * 7")  # nothing printed: the model is told why the result is empty


@pytest.mark.parametrize("code, expected", [
    ("def f(:\n    pass", "SyntaxError"),
    ("x = 1\nprint(x / 0)", "ZeroDivisionError: division by zero"),
    ("import numpy", "ModuleNotFoundError: No module named 'numpy'"),  # -S: the standard library only
])
def test_python_returns_the_exception_as_text(code, expected):
    result = python(code)
    assert result.splitlines()[-1].startswith(expected.split(":")[0]) and expected in result


def test_python_keeps_what_was_printed_before_an_exception():
    result = python("print('partial')\nraise KeyError('k')")
    assert result.splitlines()[0] == "partial" and result.splitlines()[-1] == "KeyError: 'k'"


FORK_A_SLEEPER = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"


def test_python_times_out_and_kills_what_it_forked():
    tool = make_python_tool(timeout=1.0)
    start = time.monotonic()
    result = tool(FORK_A_SLEEPER + "print(pid, flush=True)\nwhile True: pass")
    assert time.monotonic() - start < 2.0
    assert result.splitlines()[-1].startswith("TimeoutError")
    _assert_killed(int(result.splitlines()[0]))


def test_python_kills_children_left_running_after_a_normal_exit():
    _assert_killed(int(python(FORK_A_SLEEPER + "print(pid)")))


def _assert_killed(pid):
    for _ in range(100):  # SIGKILL is immediate; init reaps the orphan soon after
        if _is_gone(pid):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} forked by the sandboxed code is still running")


def _is_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # killed, not yet reaped
    except FileNotFoundError:
        return True


def test_python_memory_limit_gives_memory_error():
    assert python("b = bytearray(2**34)").splitlines()[-1] == "MemoryError"


def test_python_file_size_limit():
    assert "File too large" in python("open('big', 'wb').write(b'0' * 10**8)")


def test_python_caps_its_output():
    tool = make_python_tool(max_output=100)
    assert tool("print('x' * 1000)") == "x" * 100 + "…[truncated]"
    flood = tool("while True: print('y' * 10**6)")  # stopped by the file-size limit, not held in memory
    assert flood.startswith("y" * 100 + "…[truncated]") and "File too large" in flood


def test_python_runs_in_a_fresh_temp_dir_that_is_removed():
    cwd = python("import os\nopen('scratch.txt', 'w').write('hi')\nprint(os.getcwd())").strip()
    assert os.path.realpath(cwd).startswith(os.path.realpath(tempfile.gettempdir()))
    assert not os.path.exists(cwd)
    assert python("import os; print(os.listdir('.'))").strip() == "[]"


def test_python_does_not_see_the_parents_environment(monkeypatch):
    monkeypatch.setenv("GRPO_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    result = python("import os, sys\nprint(sorted(os.environ))\nprint(os.environ.get('GRPO_SECRET'))\n"
                    "print(sys.flags.isolated)")
    names, secret, isolated = result.splitlines()
    assert secret == "None" and "hunter2" not in result and isolated == "1"
    assert "PYTHONPATH" not in names and "HOME" not in names and "PATH" in names


def test_python_calls_from_a_thread_pool_do_not_mix():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(python, [f"print({i} * {i})" for i in range(8)]))
    assert [int(r) for r in results] == [i * i for i in range(8)]


@pytest.mark.parametrize("tool, name, parameter", [
    (python, "python", "code"),
    (make_python_tool(timeout=1.0), "python", "code"),
    (calculator, "calculator", "expression"),
])
def test_json_schema(tool, name, parameter):
    schema = get_json_schema(tool)["function"]
    assert schema["name"] == name and schema["description"]
    assert schema["parameters"]["required"] == [parameter]
    assert schema["parameters"]["properties"] == {
        parameter: {"type": "string", "description": schema["parameters"]["properties"][parameter]["description"]}}


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("-2 ** 2", "-4"),
    ("2 ** 3 ** 2", "512"),
    ("2 ** -2", "0.25"),
    ("0.1 + 0.2", "0.3"),
    ("sqrt(16) + abs(-1)", "5"),
    ("floor(2.5) + ceil(2.5)", "5"),
    ("round(3.14159, 2)", "3.14"),
    ("log(exp(2))", "2"),
    ("cos(0) + sin(0)", "1"),
    ("2 * pi", "6.28318530717959"),
    ("10 ** 100", "1" + "0" * 100),
])
def test_calculator(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, expected", [
    ("1 / 0", "Error: ZeroDivisionError"),
    ("9 ** 9 ** 9", "Error: ValueError: exponent too large"),
    ("(2 ** 9000) ** 2", "Error: ValueError: exponent too large"),
    ("10.0 ** 400", "Error: OverflowError"),
    ("sqrt(-1)", "Error: ValueError: math domain error"),
    ("(-8) ** (1 / 3)", "Error: the result is a complex number"),
    ("__import__('os')", "Error: ValueError: unsupported expression"),
    ("().__class__", "Error: ValueError: unsupported expression"),
    ("x + 1", "Error: ValueError: unsupported expression"),
    ("'a' * 3", "Error: ValueError: unsupported expression"),
    ("1 +", "Error: SyntaxError"),
    ("-" * 2000 + "1", "Error: expression longer than"),
])
def test_calculator_refuses(expression, expected):
    assert calculator(expression).startswith(expected)
