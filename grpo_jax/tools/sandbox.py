"""Tools for tool-calling RL (TRL's ``tools=``): a resource-limited Python subprocess and a safe calculator.

A tool is a plain function with type hints and a Google-style docstring; transformers' ``get_json_schema`` turns it
into the schema the chat template renders. User-code failures (an exception, a timeout, a memory limit) come back as
text the model can read, not as exceptions. The sandbox limits resources only: it is not a security boundary (no
network or filesystem isolation; the code runs as the trainer's user).
"""
import ast
import contextlib
import math
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time

# Sets the limits, then replaces itself with a fresh interpreter that reads the code from stdin: rlimits survive
# exec, and unlike `preexec_fn` this is safe from the trainer's tool thread pool.
_BOOTSTRAP = """import os, resource, sys
cpu, mem, fsize = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-"])
"""
FILE_SIZE_LIMIT = 16 << 20  # bytes, any one file the code writes (stdout included)
STDERR_LINES = 5  # of a traceback, the lines a model needs: the failing line and the exception


def make_python_tool(timeout: float = 5.0, memory_mb: int = 1024, max_output: int = 2000):
    """Returns a `python(code)` tool with these limits: wall-clock seconds, address space (MiB), output chars."""
    cpu_seconds = math.ceil(timeout) + 1  # a backstop: the wall-clock timeout normally fires first

    def python(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it prints.

        Only the standard library is available. Each call starts from scratch: no variables survive between calls.
        Use print() to show results.

        Args:
            code: The Python source code to run.
        """
        with tempfile.TemporaryDirectory(prefix="grpo_jax_sandbox_", ignore_cleanup_errors=True) as tmp:
            cwd = os.path.join(tmp, "work")
            os.mkdir(cwd)
            out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            limits = [str(cpu_seconds), str(memory_mb << 20), str(FILE_SIZE_LIMIT)]
            # stdout/stderr go to files (capped by RLIMIT_FSIZE), never to pipes the parent would buffer in memory.
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, *limits], stdin=subprocess.PIPE, stdout=out,
                    stderr=err, cwd=cwd, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    start_new_session=True)
                with contextlib.suppress(BrokenPipeError), proc.stdin:  # broken: it died early, stderr says why
                    proc.stdin.write(code.encode("utf-8", "replace"))
                deadline, exited = time.monotonic() + timeout, None
                while exited is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                    exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                # Kills what it forked too, and before `wait` reaps the leader, so the group id is still ours.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = exited is None
            stdout, stderr = _read_head(out_path, max_output + 1), _read_tail(err_path, 8192)
        if len(stdout) > max_output:
            stdout = stdout[:max_output] + "…[truncated]"
        if timed_out:
            return _join(stdout, f"TimeoutError: execution exceeded the {timeout:g} s time limit")
        if proc.returncode == 0:
            return stdout or "(no output: use print() to show a result)"
        if proc.returncode == -signal.SIGXCPU:
            return _join(stdout, f"TimeoutError: execution exceeded the {cpu_seconds} s CPU-time limit")
        if proc.returncode < 0:
            return _join(stdout, f"Error: process killed by {signal.Signals(-proc.returncode).name}")
        tail = "\n".join(line[:200] for line in stderr.rstrip().splitlines()[-STDERR_LINES:])
        return _join(stdout, tail[-max_output:] or f"Error: exit status {proc.returncode}")

    python.__qualname__ = "python"
    return python


def _read_head(path, n):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(n)


def _read_tail(path, n):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode("utf-8", "replace")


def _join(stdout, message):
    return f"{stdout.rstrip()}\n{message}" if stdout.strip() else message


python = make_python_tool()

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos,
              "floor": math.floor, "ceil": math.ceil, "abs": abs, "round": round}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 1000  # longer inputs can exhaust the parser's stack
MAX_POWER_BITS = 10_000  # an integer power's result size: 9**9**9 is refused instead of computed for minutes


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports numbers, + - * / // % **, parentheses, the constants pi and e, and the functions sqrt, log, exp, sin,
    cos, floor, ceil, abs and round.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "sqrt(2) * (3 + 4) ** 2".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
        if isinstance(value, complex):  # (-8) ** (1/3)
            return "Error: the result is a complex number"
        return str(value) if isinstance(value, int) else f"{value:.15g}"  # 15 digits: 0.1 + 0.2 reads 0.3
    except SyntaxError as e:
        return f"Error: SyntaxError: {e.msg}"
    except (ArithmeticError, ValueError, TypeError, RecursionError) as e:  # ValueError: math domain, huge int str
        return f"Error: {type(e).__name__}: {e}"


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
                and right * abs(left).bit_length() > MAX_POWER_BITS):
            raise ValueError(f"exponent too large (results over {MAX_POWER_BITS} bits are refused)")
        return _BINARY[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords and 1 <= len(node.args) <= 2):
        return _FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args))
    raise ValueError(f"unsupported expression: {ast.unparse(node)[:80]!r}")
