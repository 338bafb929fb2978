"""Trackers: a missing package stops the command line before anything is made; W&B logs offline, in one line and
without waiting, when its server cannot be reached or refuses the login."""

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.io.test_checkpoint import ROOT, TINY

HIDDEN_CLI = "import sys; sys.modules[sys.argv.pop(1)] = None; from grpo_jax.api.cli import main; sys.exit(main())"


@pytest.mark.parametrize("tracker, module", [("wandb", "wandb"), ("tensorboard", "tensorboardX")])
def test_a_missing_tracker_package_stops_the_command_line_before_anything_is_made(tmp_path, tracker, module):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", HIDDEN_CLI, module, "--no-progress", f"output_dir={out}", *TINY,
                             "max_steps=1", f"report_to=[jsonl,{tracker}]"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"grpo-jax: report_to lists {tracker} but {module} is not installed: pip install -e " \
        f"\".[{tracker}]\" (or pip install {module}), or remove {tracker} from report_to\n"
    assert not out.exists()


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from grpo_jax.io.reporting import MetricsWriter
    for step in (1, 2):  # a run, then its resume from step 1
        writer = MetricsWriter(Path(sys.argv[1]), max_steps=2, initial_step=step - 1, show_progress=False,
                               history=None if step == 1 else [], report_to=("jsonl", "wandb"))
        writer.write({"step": step, "reward": 0.25 * step})
        writer.close()
""")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A W&B server that answers every request as a wrong API key."""

    def do_POST(self):
        self.send_response(401)
        self.end_headers()
        self.wfile.write(json.dumps({"errors": [{"message": "invalid API key"}]}).encode())

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("api_key, server", [(None, "default"), ("f" * 40, "default"), ("f" * 40, "refusing")])
def test_wandb_logs_offline_when_its_server_cannot_be_reached_or_refuses(tmp_path, api_key, server):
    """This machine has no internet: the default server cannot be reached (on one that has, the login fails
    instead: no key, or a fake one). No WANDB_MODE, no login kept in the home folder."""
    pytest.importorskip("wandb")
    from tests.api.test_trainer import _wandb_history

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"), **({"WANDB_API_KEY": api_key} if api_key else {}))
    httpd = None
    if server == "refusing":
        httpd = http.server.HTTPServer(("127.0.0.1", 0), _Refusing)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        env["WANDB_BASE_URL"] = f"http://127.0.0.1:{httpd.server_port}"
    out = tmp_path / "run"
    out.mkdir()
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-c", WRITER, str(out)], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)  # wandb's own wait for an unreachable server: 90 s a try
    finally:
        if httpd is not None:
            httpd.shutdown()
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - start < 60
    ours = [line for line in result.stderr.splitlines() if line.startswith("grpo_jax: report_to=wandb")]
    assert len(ours) == 2, result.stderr  # one line for each part of the run
    assert all("logging offline" in line and f"wandb sync {out / 'wandb'}/offline-run-*" in line for line in ours)
    # both parts logged offline into one W&B run, the id kept in output_dir/wandb
    runs = sorted((out / "wandb").glob("offline-run-*"))
    run_id = (out / "wandb" / "run_id").read_text()
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)
    logged = [row for part in runs for row in _wandb_history(out, part.name)]
    assert [(row["_step"], row["train/reward"]) for row in logged] == [(1, 0.25), (2, 0.5)]
