"""The `report_to` trackers beside `metrics.jsonl`: TensorBoard (tensorboardX) and Weights & Biases.

`check_installed(report_to)` runs before a run makes anything (`grpo_jax.api.run.check_inputs`); `open_tracker` opens one
for `reporting.MetricsWriter`. W&B starts online when its server answers and the login works; otherwise it logs
offline into `output_dir/wandb` and says so in one line (with the `wandb sync` command that uploads it later), so an
unreachable server never hangs or stops a run. `WANDB_MODE` is followed as set.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

_MODULES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}  # module, extra
PROBE_SECONDS = 5.0  # how long the W&B server gets to accept a connection before the run logs offline


def check_installed(report_to) -> None:
    """A one-line ValueError naming the extra to install for each tracker of `report_to` whose package is missing."""
    for name in report_to:
        if name in _MODULES and importlib.util.find_spec(_MODULES[name][0]) is None:
            module, extra = _MODULES[name]
            raise ValueError(f"report_to lists {name} but {module} is not installed: pip install -e \".[{extra}]\" "
                             f"(or pip install {module}), or remove {name} from report_to")


def text(value) -> str:
    """A prompt or completion as one string: a conversation's messages by their content."""
    return value if isinstance(value, str) else "\n".join(str(m.get("content", m)) for m in value)


def cell(value) -> str:
    """A completion table's cell as text (floats to two decimals, None empty)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return text(value) if isinstance(value, str | list) else str(value)  # log_extra columns hold anything


class _TensorBoard:
    """Scalars and completion tables as TensorBoard event files (tensorboardX's FileWriter), tags kept exact
    (`eval/pass@1`: SummaryWriter would rewrite the characters TensorFlow node names lack)."""

    def __init__(self, output_dir: Path, purge_step: int | None):
        from tensorboardX import FileWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import text as text_summary

        self.summary, self.text = Summary, text_summary
        # one file per part of a run, in order even when two start within the second their names count
        self.writer = FileWriter(str(output_dir / "tensorboard"), filename_suffix=f".{purge_step or 0:09d}")
        if purge_step is not None:  # a resumed run: TensorBoard drops the events logged from this step on before
            self.writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalars(self, metrics: dict, step: int) -> None:
        values = [self.summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool)]
        self.writer.add_summary(self.summary(value=values), step)

    def completions(self, rows: list[dict], step: int) -> None:
        header = list(rows[0])
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell(row[k]).replace("|", "\\|").replace("\n", "<br>") for k in header) + " |"
                  for row in rows]
        self.writer.add_summary(self.text("completions", "\n".join(lines)), step)

    def close(self) -> None:
        self.writer.close()


def _unreachable(url: str, timeout: float) -> str | None:
    """Why a connection to `url`'s host fails within `timeout` seconds (name lookup included), or None when it opens.
    In a thread: a name lookup takes no timeout of its own."""
    parts = urllib.parse.urlsplit(url)
    outcome = []

    def connect():
        try:
            socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                     timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e.strerror or str(e) or type(e).__name__)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer in {timeout:g} s"


def _offline_reason(wandb) -> str | None:
    """Why W&B must log offline although `WANDB_MODE` does not say so (its server does not answer), or None."""
    settings = wandb.setup().settings  # env, settings files and `wandb login --host` merged, as wandb.init reads them
    if settings.mode in ("offline", "dryrun", "disabled"):
        return None  # the user's choice, followed as it is
    scheme = urllib.parse.urlsplit(settings.base_url).scheme
    if scheme in urllib.request.getproxies():
        return None  # reached through a proxy: wandb.init's own timeout bounds the attempt
    error = _unreachable(settings.base_url, PROBE_SECONDS)
    return None if error is None else f"the W&B server {settings.base_url} cannot be reached ({error})"


class _WandB:
    """Scalars and completion tables in a W&B run, resumed with the run (its id kept in output_dir/wandb); offline
    when the server cannot be reached or refuses the login."""

    def __init__(self, output_dir: Path, run_config: dict):
        import wandb

        self.wandb = wandb
        id_file = output_dir / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        init = dict(project=os.environ.get("WANDB_PROJECT", "grpo_jax"), name=output_dir.name, dir=str(output_dir),
                    config=run_config, id=run_id, resume="allow")
        reason = _offline_reason(wandb)
        if reason is None:
            try:
                self.run = wandb.init(**init)
                return
            except wandb.errors.Error as e:  # no API key, a key the server refuses, its init_timeout passed
                wandb.teardown()  # else the failed run keeps its id and the offline run below is refused
                reason = "W&B could not start online (" + (str(e).strip().splitlines() or [type(e).__name__])[0] + ")"
        self.run = wandb.init(**init, mode="offline")
        print(f"grpo_jax: report_to=wandb: {reason}: logging offline to {output_dir / 'wandb'}; upload it once "
              f"online with `wandb sync {output_dir / 'wandb'}/offline-run-*`", file=sys.stderr, flush=True)

    def scalars(self, metrics: dict, step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def completions(self, rows: list[dict], step: int) -> None:
        columns = ["step", *rows[0]]
        data = [[step, *(v if isinstance(v, (int, float)) or v is None else text(v) for v in row.values())]
                for row in rows]
        self.run.log({"completions": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(name: str, output_dir: Path, purge_step: int | None, run_config: dict):
    """The tracker `name` of `report_to` (tensorboard or wandb) writing into `output_dir`; `purge_step`: the first
    step of a resumed run (TensorBoard drops what the run logged from it on before), None for a new run."""
    check_installed((name,))
    return _TensorBoard(output_dir, purge_step) if name == "tensorboard" else _WandB(output_dir, run_config)
