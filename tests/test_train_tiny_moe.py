"""scripts/train_tiny_moe.py (the bundled model's training script) on a tiny model and a small corpus.

One short training run exports a folder; the tests check it against things computed without the script's own forward:
the loss against a numpy float64 cross entropy of the logits of the exported folder as ft_jax.load reads it (its dense
model with a top-k-only expert backend over the loaded host banks, written here), the greedy decode of ft_jax.load
against the training forward's argmax continuation, the dense against the capacity dispatch, and the bundled
checkpoint's tensors through the script's import/export.
"""

import importlib.util
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ft_jax
from ft_jax.api import bundled_model_path
from ft_jax.config import config_from_dict

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "train_tiny_moe.py")
# hidden 32, 2 layers, 4 experts top-2; a step is 4 x 64 = 256 rows (> FFI_MAX_ROWS: the differentiable XLA dot).
TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--experts", "4", "--top-k", "2",
        "--intermediate-size", "32", "--seq-len", "64", "--batch-size", "4", "--eval-windows", "8"]


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny_moe"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_tiny_moe"]


@pytest.fixture(scope="module")
def run(tm, tmp_path_factory):
    """Corpus, flags, config and the folder of a 30-step training run (capacity dispatch, the default)."""
    tmp = tmp_path_factory.mktemp("train")
    lines = [f"{name}: the {w} of {x} is {n} and {w} again.\n" for n in range(400)
             for name, w, x in [(("ANNE", "BEN", "CLEO")[n % 3], ("rose", "crown", "sword", "ship")[n % 4],
                                 ("york", "rome", "kent")[n % 3])]]
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(lines))
    out = tmp / "out"
    argv = [str(corpus), "--out", str(out), *TINY, "--steps", "30", "--lr", "1e-2", "--warmup", "5", "--eval-every", "0",
            "--sample-tokens", "24", "--sample-prompt", "ANNE:"]
    assert tm.main(argv) == 0
    args = tm.parse_args(argv)
    return {"corpus": str(corpus), "out": str(out), "args": args,
            "cfg": config_from_dict(tm.hf_config(args, "float32")), "data": tm.load_bytes(str(corpus))}


def _trained(tm, run):
    cfg = run["cfg"]
    return tm.build(cfg, tm.read_checkpoint(run["out"], tm.init_tensors(cfg, 0)))


def _val_windows(tm, run, count=4):
    data = run["data"]
    return tm.fixed_windows(data[int(0.9 * data.size):], count, run["cfg"].max_position_embeddings)


def _nll_f64(logits, targets) -> float:
    """Mean negative log-likelihood in float64 numpy: logits [B, T, V], targets [B, T]."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1).mean())


def test_training_loss_equals_loaded_checkpoint_cross_entropy(tm, run):
    """The training-side loss of fixed windows = the float64 cross entropy of the logits that the exported folder,
    as ft_jax.load reads it, gives: its dense model with the top-k experts taken from the loaded host banks."""
    cfg, (graphdef, params) = run["cfg"], _trained(tm, run)
    windows = _val_windows(tm, run, 2)  # [2, 65]
    logits, _, _, _ = tm.forward(graphdef, params, jnp.asarray(windows[:, :-1]))
    train_side = float(tm.cross_entropy(logits, jnp.asarray(windows[:, 1:])))

    ckpt = ft_jax.load(run["out"], dtype="float32", policy="host-all", measure=False).checkpoint
    gate_up, down = jnp.asarray(ckpt.banks.gate_up.numpy()), jnp.asarray(ckpt.banks.down.numpy())  # [L*E, 2I, H], ...
    E, I = cfg.num_experts, cfg.moe_intermediate_size

    def topk_experts(moe_layer, x, ids, w, state):  # only the k chosen experts of each token, gathered by flat id
        flat = moe_layer * E + ids  # [N, k]
        gu = jnp.einsum("nh,nkoh->nko", x, gate_up[flat], precision="highest")  # [N, k, 2I]
        act = jax.nn.silu(gu[..., :I]) * gu[..., I:]
        return jnp.einsum("nki,nkhi,nk->nh", act, down[flat], w, precision="highest"), state

    B, T = windows.shape[0], windows.shape[1] - 1
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ref_logits, _, _ = ckpt.model(jnp.asarray(windows[:, :-1]), positions, ckpt.model.init_kv_cache(B, T), None,
                                  topk_experts)
    reference = _nll_f64(ref_logits, windows[:, 1:])
    assert 1.0 < reference < math.log(256)  # trained, not uniform
    assert train_side == pytest.approx(reference, abs=1e-5)


def test_loss_decreases(tm, run):
    """Validation loss of the exported model is well below the same seed's initial weights (about ln 256)."""
    cfg = run["cfg"]
    windows = jnp.asarray(_val_windows(tm, run))
    losses = []
    for graphdef, params in (tm.build(cfg, tm.init_tensors(cfg, 0)), _trained(tm, run)):
        logits = tm.forward(graphdef, params, windows[:, :-1])[0]
        losses.append(_nll_f64(logits, windows[:, 1:]))
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)
    assert losses[1] < losses[0] - 2.5


def test_loaded_greedy_decode_equals_training_forward(tm, run):
    """ft_jax.load of the exported folder (offloaded experts, KV cache) decodes greedily the same bytes as the
    training forward's argmax continuation (full windows, dense experts)."""
    cfg, (graphdef, params) = run["cfg"], _trained(tm, run)
    logits_fn = jax.jit(lambda p, toks: tm.forward(graphdef, p, toks)[0][0])
    _, expected = tm.sample(logits_fn, params, cfg, "ANNE:", 40, 0.0, 0)
    model = ft_jax.load(run["out"], policy="fixed-cap:1", cache=2, measure=False)
    got = model.generate("ANNE:", max_new_tokens=40, temperature=0.0)
    assert got.token_ids[0] == expected
    assert len(set(expected)) > 3  # a trained continuation, not one repeated byte


def test_dense_and_capacity_dispatch_agree_without_drops(tm, run):
    """Capacity N (every assignment fits) gives the dense loss and 0 dropped; a small capacity drops and differs."""
    graphdef, params = _trained(tm, run)
    batch = jnp.asarray(tm.random_windows(run["data"], np.random.default_rng(1), 4, 64))  # [4, 65]

    def loss(capacity):
        logits, _, _, dropped = tm.forward(graphdef, params, batch[:, :-1], capacity)
        return float(tm.cross_entropy(logits, batch[:, 1:])), float(dropped)

    dense, (full, full_drop), (small, small_drop) = loss(0), loss(4 * 64), loss(16)
    assert dense[1] == 0.0 and full_drop == 0.0
    assert full == pytest.approx(dense[0], abs=1e-6)
    assert small_drop > 0.1 and abs(small - dense[0]) > 1e-3


def test_bundled_checkpoint_round_trips_through_the_script(tm):
    """The bundled checkpoint read into the training layout and exported again gives its tensors bit for bit (names,
    shapes, values): the export layout is the bundled one."""
    from safetensors.numpy import load_file

    args = tm.parse_args(["unused.txt", "--out", "unused"])  # default flags = the bundled model
    cfg = config_from_dict(tm.hf_config(args, "float32"))
    stored = load_file(os.path.join(bundled_model_path(), "model.safetensors"))
    graphdef, params = tm.build(cfg, tm.read_checkpoint(bundled_model_path(), tm.init_tensors(cfg, 0)))
    assert isinstance(params["dense"], nnx.State)
    exported = tm.export_tensors(graphdef, params, cfg, np.float32)
    assert sorted(exported) == sorted(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_checkpoint_of_other_flags_is_refused(tm, run):
    """--init-from / --evaluate-only of a folder that does not match the model flags: one line naming the tensor."""
    args = tm.parse_args(["unused.txt", "--out", "unused"])  # the bundled model's flags, not the tiny run's
    cfg = config_from_dict(tm.hf_config(args, "float32"))
    with pytest.raises(ValueError, match=r"does not match the model flags: tensor lm_head.weight: expected "
                                         r"\(256, 128\), got \(256, 32\)"):
        tm.read_checkpoint(run["out"], tm.init_tensors(cfg, 0))
