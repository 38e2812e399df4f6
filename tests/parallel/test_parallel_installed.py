"""Parallelism is installed on the layers, not threaded through them: ``enable_parallelism`` puts the Ulysses
attention exchange on every attention module and the context-parallel expert exchange on every MoE layer, once; the
block, attention, feed-forward and MoE forwards never test for a parallel mode, and the attention mask describes masks
only. (That EP and CP enabled in either order equal one process runs on gloo ranks: ``test_cp_models.py``.)"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch
from helpers.modular_testing_utils import tiny_refiner
from helpers.tiny_transformer import TINY

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.attention_magi2 import (
    Magi2Attention,
    Magi2AttentionMask,
    Magi2AttnProcessor,
    Magi2WindowAttnProcessor,
    _Magi2AttnProcessorBase,
)
from diffusers_magi2.models.feedforward_magi2 import Magi2FeedForward, Magi2MoEFeedForward
from diffusers_magi2.models.transformer_magi2 import Magi2TransformerBlock
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformerBlock
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.parallel.context_parallel import Magi2ContextParallelGroup
from diffusers_magi2.parallel.exchanges import (
    Magi2ContextParallelExpertExchange,
    Magi2ExpertParallelExchange,
    Magi2LocalAttentionExchange,
    Magi2LocalExpertExchange,
    Magi2UlyssesAttentionExchange,
)


#: every forward a block runs, down to the routed experts
FORWARDS = [
    Magi2TransformerBlock.forward,
    Magi2RefinerTransformerBlock.forward,
    Magi2Attention.forward,
    _Magi2AttnProcessorBase.__call__,
    _Magi2AttnProcessorBase._attend_shard,
    Magi2AttnProcessor.attend,
    Magi2WindowAttnProcessor.attend,
    Magi2FeedForward.forward,
    Magi2MoEFeedForward.forward,
    Magi2MoEFeedForward._forward_tokens,
    Magi2MultiHeadMoE.forward,
    Magi2MultiHeadMoE.forward_local_heads,
]

#: names that carry parallel state; a forward that reads one branches on a parallel mode
PARALLEL_STATE = ("context_parallel", "ep_size", "ep_group", "ep_rank", "world_size", "ulysses", "cp_")


#: what an input check may test for (the type of an argument, not a module's parallel mode)
INPUT_TYPES = ("torch.Tensor", "int", "bool", "float", "str", "tuple", "list", "dict")


def parallel_state_checks(fn) -> list[str]:
    """What in ``fn``'s source tests for a parallel mode: ``isinstance`` calls (but input type checks), and any name, attribute, argument or
    ``getattr``/``hasattr`` string naming parallel state (docstrings and messages are not read)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            tested = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            if tested not in INPUT_TYPES:
                found.append(f"isinstance(..., {tested}) at line {node.lineno}")
        names = []
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            names += [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [f"{n!r} at line {node.lineno}" for n in names if any(p in n for p in PARALLEL_STATE)]
    return found


@pytest.mark.parametrize("fn", FORWARDS, ids=lambda fn: fn.__qualname__)
def test_no_forward_tests_for_a_parallel_mode(fn):
    assert parallel_state_checks(fn) == [], fn.__qualname__


def test_the_check_sees_what_the_layers_once_did():
    def threaded(self, hidden_states, dispatch, attention_mask):
        cp = getattr(attention_mask, "context_parallel", None)
        kwargs = {"context_parallel": cp} if isinstance(self.mlp, Magi2MoEFeedForward) else {}
        return self.mlp(hidden_states, dispatch, **kwargs) if self.moe.ep_size > 1 else hidden_states

    found = parallel_state_checks(threaded)
    assert any(f.startswith("isinstance") for f in found)
    assert any("'context_parallel'" in f for f in found) and any("'ep_size'" in f for f in found)


def test_the_attention_mask_holds_no_parallel_state():
    fields = {f.name for f in dataclasses.fields(Magi2AttentionMask)}
    assert fields == {"segment_lengths", "window", "dense_mask", "_cache"}


def _fake_cp(size: int) -> Magi2ContextParallelGroup:
    """A CP group record for installing exchanges (no collective runs here)."""
    return Magi2ContextParallelGroup(group=None, rank=0, size=size, device=torch.device("cpu"))


def test_one_process_layers_carry_the_local_exchanges():
    model = Magi2Transformer3DModel(**{**TINY, "moe_layers": [0, 1]})
    attentions = [m for m in model.modules() if isinstance(m, Magi2Attention)]
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    assert attentions and moes
    assert all(type(m.exchange) is Magi2LocalAttentionExchange for m in attentions)
    assert all(type(m.exchange) is Magi2LocalExpertExchange and not m.exchange.sync_free for m in moes)


def test_enable_parallelism_installs_ulysses_and_the_context_parallel_expert_exchange_once():
    model = Magi2Transformer3DModel(**{**TINY, "moe_layers": [0, 1]})
    model._install_context_parallel_exchanges(_fake_cp(2))
    attentions = [m.exchange for m in model.modules() if isinstance(m, Magi2Attention)]
    assert {type(a) for a in attentions} == {Magi2UlyssesAttentionExchange} and len({id(a) for a in attentions}) == 1
    moes = [m.exchange for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    assert {type(e) for e in moes} == {Magi2ContextParallelExpertExchange}
    # EP degree 1: the tokens stay (no exchange), so the layer may still run in chunks, without host reads
    assert all(e.sync_free and e.token_chunk(64) == 64 and e.layout.ep_size == 1 for e in moes)
    # a processor chosen afterwards keeps the installed Ulysses attention (it lives on the module)
    model.set_attn_processor(Magi2AttnProcessor(upcast_off_cuda=False))
    assert all(
        type(m.exchange) is Magi2UlyssesAttentionExchange for m in model.modules() if isinstance(m, Magi2Attention)
    )


def test_an_expert_parallel_layer_runs_unchunked_and_needs_its_group():
    moe = next(m for m in Magi2Transformer3DModel(**TINY).modules() if isinstance(m, Magi2MultiHeadMoE))
    ep = Magi2MultiHeadMoE(moe.config, ep_rank=0, ep_size=2)  # a layer with EP's head layout, no group
    assert type(ep.exchange) is Magi2ExpertParallelExchange and ep.exchange.token_chunk(64) is None
    with pytest.raises(ValueError, match="needs ep_group"):
        ep(torch.zeros(3, ep.hidden_size))


def test_enable_parallelism_installs_nothing_when_an_expert_parallel_layer_does_not_tile_the_ranks():
    model = Magi2Transformer3DModel(**{**TINY, "moe_layers": [0, 1]})
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    model.transformer_blocks[1].mlp.moe_mlp = Magi2MultiHeadMoE(moes[0].config, ep_rank=0, ep_size=2)
    before = {id(m): m.exchange for m in model.modules() if hasattr(m, "exchange")}
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.mlp\.moe_mlp: expert parallelism runs over ranks"):
        model._install_context_parallel_exchanges(_fake_cp(2))
    assert {id(m): m.exchange for m in model.modules() if hasattr(m, "exchange")} == before
    with pytest.raises(ValueError, match="divides neither the context-parallel degree"):
        model._install_context_parallel_exchanges(_fake_cp(3))


def test_refiner_enable_parallelism_installs_ulysses_on_every_attention():
    model = tiny_refiner()
    model._install_context_parallel_exchanges(_fake_cp(3))
    attentions = [m for m in model.modules() if isinstance(m, Magi2Attention)]
    assert len(attentions) == 2 and all(type(m.exchange) is Magi2UlyssesAttentionExchange for m in attentions)


def test_the_package_reads_no_launcher_environment():
    """The launch rules live in ``examples/launch_rules.py``; the package takes the initialised group or a mesh: no
    package module names a launcher variable or creates accelerate's ``PartialState``."""
    from helpers.fixtures import REPO_ROOT

    def readers(path):
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
                found.append(f"{path.name}:{node.lineno} {node.value}")
            if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
                name = getattr(node, "id", None) or getattr(node, "attr", None) or node.name
                if name == "PartialState":
                    found.append(f"{path.name}:{getattr(node, 'lineno', '?')} PartialState")
        return found

    package = [r for path in sorted((REPO_ROOT / "diffusers_magi2").rglob("*.py")) for r in readers(path)]
    assert package == []
    assert readers(REPO_ROOT / "examples" / "launch_rules.py")  # the check sees the examples' launch rules
