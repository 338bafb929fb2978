"""Export: `grpo-jax export` of a checkpoint writes the params it holds (Hugging Face or native format)."""

import jax
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax import export
from grpo_jax.cli import main as cli_main
from tests.test_checkpoint import _flat, _train


def test_export_round_trip(tmp_path, capsys):
    """`grpo-jax export` of a run (and of one step folder) writes the params the checkpoint holds."""
    _train(tmp_path / "run", "max_steps=2", "save_steps=1")
    for source, step in ((tmp_path / "run", 2), (tmp_path / "run" / "checkpoints" / "1", 1)):
        out = tmp_path / f"export{step}"
        assert cli_main(["export", "--checkpoint", str(source), "--out", str(out)]) == 0
        assert f"step {step} written" in capsys.readouterr().out
        mngr = ocp.CheckpointManager((tmp_path / "run" / "checkpoints").absolute())
        saved = jax.device_get(mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore())).state["params"])
        if (out / "config.json").is_file():  # Hugging Face format
            from grpo_jax.models import from_pretrained
            _, params = from_pretrained(str(out))
        else:
            _, params = export.load_native(out)
        loaded, saved = _flat(jax.device_get(params)), _flat(saved)
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded.pop(key), value, err_msg=key)
        # Qwen2 in transformers always has q/k/v biases: a model without them comes back with zero biases
        assert all(key.endswith("bias/value") and not value.any() for key, value in loaded.items()), sorted(loaded)
        assert (out / "tokenizer.json").is_file()
    assert cli_main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 1
    assert "neither a run's output_dir" in capsys.readouterr().err
