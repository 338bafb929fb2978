"""The training chat template shipped for tools without trl (grpo_jax/tools/templates.py): TRL 1.16's files, the
released Qwen3 template not prefix-preserving for a tool message and its training template prefix-preserving, and a
run's tools render Qwen3 through ours with trl out of reach, as TRL would."""

import sys

import pytest

from grpo_jax.tools import calls, templates
from tests.tools.test_tool_parsers import multiply
from tests.trl_tools import qwen_tokenizer

TOOL = [{"role": "tool", "name": "multiply", "content": "12"}]


def _tokenizer(name: str, training: bool = False):
    """The test BPE tokenizer (Qwen's chat tokens) with a shipped template."""
    file = templates.FOLDER / f"{name}{'_training' if training else ''}.jinja"
    return qwen_tokenizer(chat_template=file.read_text())


def test_the_shipped_templates_are_trls():
    utils = pytest.importorskip("trl.chat_template_utils")
    for name in templates.NAMES:
        for suffix in ("", "_training"):
            assert (templates.FOLDER / f"{name}{suffix}.jinja").read_text() == \
                getattr(utils, f"{name}{suffix}_chat_template"), f"{name}{suffix}"


@pytest.mark.parametrize("name", templates.NAMES)
def test_each_released_template_breaks_the_prefix_and_its_training_template_keeps_it(name):
    released = _tokenizer(name)
    with pytest.raises(ValueError, match="not prefix-preserving"):  # the earlier turn's thinking block goes
        calls.suffix_ids(released, TOOL)
    assert templates.training_chat_template(released) == (templates.FOLDER / f"{name}_training.jinja").read_text()
    trained = _tokenizer(name, training=True)
    suffix = calls.suffix_ids(trained, TOOL)
    assert suffix and "12" in trained.decode(suffix)  # the tool's result, then the next assistant turn's opening
    assert templates.training_chat_template(trained) is None  # only the released texts are recognised


def test_qwen3_tools_render_through_our_template_without_trl(monkeypatch):
    tok = _tokenizer("qwen3")
    try:
        from trl.chat_template_utils import get_training_chat_template
        expected = get_training_chat_template(tok)
    except ImportError:
        expected = None
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    tooling = calls.build((multiply,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    assert tooling.chat_template == templates.training_chat_template(tok)
    if expected is not None:
        assert tooling.chat_template == expected  # what TRL's GRPOTrainer renders with


def test_an_unknown_template_that_breaks_the_prefix_names_the_families_without_trl(monkeypatch):
    tok = _tokenizer("qwen3")
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")  # no longer the released text
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)
    with pytest.raises(ValueError, match=r"none of the released templates grpo_jax has a training template for "
                                         r"\(qwen3\)"):
        calls.build((multiply,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)
