"""The peers' trunk description from numbarl layers: plain Linear/activation/LayerNorm trunks are
mirrored, and a trunk piece the generic peer cannot compute (a gate, the bottleneck, the attention
block) is refused instead of being read as a Linear because it also names a "w" and a "b"."""

import pytest

from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.torch_peer import TrunkOp, trunk_ops_from_layers


def test_plain_trunk_is_mirrored():
    ops = trunk_ops_from_layers(Mlp("trunk", 8, (16, 4)))
    assert [op.kind for op in ops] == ["linear", "relu", "linear", "relu"]
    assert ops[0] == TrunkOp("linear", "trunk.fc0.w", "trunk.fc0.b")


@pytest.mark.parametrize("kw", [{"input_gate": True}, {"kan_gate": True}, {"attention": True},
                                {"bottleneck": (0, 4, 2)}])
def test_trunk_pieces_are_refused(kw):
    with pytest.raises(TypeError, match="cannot mirror trunk layer"):
        trunk_ops_from_layers(Mlp("trunk", 8, (16, 16), **kw))
