"""Construction on the meta device (zcore.MetaInit) gives Hugging Face models
the initial weights of an eager construction, in distribution: the inits a
parent applies to its children (GPT-2's scaled residual projections, T5's
per-projection stds), HF's ``_init_weights`` by default, meta buffers (Llama's
rotary frequencies), rank 0's values on every rank whatever the init draws,
and a meta buffer that nothing sets refused; models built so generate as
the eager model with their weights does. Tiny configs built here, no
downloads; references are the same models built eagerly in this process.
The cases at world 1 run on ZCORE_TEST_DEVICE (NCCL on a GPU)."""

import math

import pytest
import torch
import transformers
from torch import nn

import devices
import zcore
from distributed import run_ranks
from zcore.errors import ConfigError

transformers.logging.set_verbosity_error()
TIMEOUT = 120
SIGMAS = 6  # standard errors a statistic may stray (a chance of ~2e-9 for a normal estimate)
# Relative gap allowed between a std and the one the init asks for: the
# matrices checked so have 4096 elements or more, whose sample std strays by
# at most 1/sqrt(2 * 4096) = 1.1%, so this is 9 standard errors.
CLOSE = 0.1


def stage3_config(world):
    return {
        "train_batch_size": 2 * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


# Hidden sizes of 64-128 give the random matrices 4096 elements and more, so
# that the std check below (about 9% at 4096) separates GPT-2's
# 0.02 / sqrt(2 * n_layer) = 0.0071 from 0.02 and T5's 0.031 (q), 0.088 (wo)
# and 0.125 (k, v, o, wi) from one another and from 1.0.
def gpt2():
    config = transformers.GPT2Config(
        n_layer=4, n_head=4, n_embd=128, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config)


def t5():
    config = transformers.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=256,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


def llama():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": gpt2, "t5": t5, "llama": llama}


def built_on_meta(rank, world, name, explicit, device="cpu"):
    devices.init_process_group(device)
    with torch.device("meta"):
        model = MODELS[name]()
    # Explicit: the root's _init_weights on every module, as a user would pass it.
    meta_init = zcore.MetaInit(init_fn=model._init_weights if explicit else None, seed=3)
    engine, *_ = zcore.initialize(model=model, config=stage3_config(world), meta_init=meta_init)
    devices.assert_on(engine, device)
    values = engine.full_state_dict()  # a collective: every rank calls it
    buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
    return values, buffers


def assert_like(got, want, name):
    """Deterministic values exactly; random ones by mean and std."""
    assert got.shape == want.shape, name
    if want.min() == want.max():  # ones, zeros
        assert torch.equal(got, want), name
        return
    n = want.numel()
    # The sample std's relative standard error is 1/sqrt(2n) (normal values),
    # so the ratio of two independent stds strays by 1/sqrt(n); the means of
    # two samples differ by std * sqrt(2/n).
    std, eager_std = got.std().item(), want.std().item()
    assert abs(std / eager_std - 1) < SIGMAS / math.sqrt(n), f"{name}: std {std:.4g}, eager {eager_std:.4g}"
    gap = abs(got.mean() - want.mean()).item()
    assert gap < SIGMAS * eager_std * math.sqrt(2 / n), f"{name}: means {got.mean():.4g}, eager {want.mean():.4g}"


def check_against_eager(name, world, explicit=False, device="cpu"):
    results = run_ranks(built_on_meta, world, name, explicit, device, launcher=world > 1, timeout=TIMEOUT)
    torch.manual_seed(0)
    eager = MODELS[name]()
    values = results[0][0]
    for param, want in eager.named_parameters():
        assert_like(values[param], want.detach(), param)
    eager_buffers = dict(eager.named_buffers())
    for _, buffers in results:  # every rank holds the whole buffers
        assert buffers.keys() == eager_buffers.keys()
        for buffer, want in eager_buffers.items():
            assert buffers[buffer].dtype == want.dtype, buffer
            assert torch.allclose(buffers[buffer], want, rtol=1e-6, atol=0), buffer
    return values, eager


@pytest.mark.parametrize("world, explicit", [(2, False), pytest.param(1, True, marks=pytest.mark.device)])
def test_gpt2_residual_projections_are_scaled_by_depth(world, explicit, device):
    values, eager = check_against_eager("gpt2", world, explicit, device)
    scaled = 0.02 / math.sqrt(2 * eager.config.n_layer)
    for layer in range(eager.config.n_layer):
        for proj in ("attn.c_proj", "mlp.c_proj"):
            # _init_weights(GPT2Attention / GPT2MLP) re-inits its child's weight.
            std = values[f"transformer.h.{layer}.{proj}.weight"].std().item()
            assert abs(std / scaled - 1) < CLOSE, (layer, proj, std)
        assert abs(values[f"transformer.h.{layer}.attn.c_attn.weight"].std().item() / 0.02 - 1) < CLOSE


def test_t5_projections_take_their_stds_from_the_parents():
    values, eager = check_against_eager("t5", 2)
    cfg = eager.config
    expected = {
        "encoder.block.0.layer.0.SelfAttention.q.weight": (cfg.d_model * cfg.d_kv) ** -0.5,
        "encoder.block.0.layer.0.SelfAttention.k.weight": cfg.d_model**-0.5,
        "decoder.block.1.layer.1.EncDecAttention.o.weight": (cfg.num_heads * cfg.d_kv) ** -0.5,
        "decoder.block.0.layer.2.DenseReluDense.wo.weight": cfg.d_ff**-0.5,
        "shared.weight": 1.0,  # the root's init, after the embedding's
    }
    for param, std in expected.items():
        assert abs(values[param].std().item() / std - 1) < CLOSE, (param, values[param].std(), std)


def test_llama_builds_on_meta_with_its_rotary_buffers():
    values, eager = check_against_eager("llama", 2)
    # The padding row, zeroed by _init_weights(nn.Embedding) after the normal draw.
    assert torch.equal(values["model.embed_tokens.weight"][0], torch.zeros(eager.config.hidden_size))


PROMPT = [[5, 6, 7, 8], [9, 10, 11, 12]]


def generated_after_meta_init(rank, world, name, device):
    """Greedy tokens of the model built on the meta device and sharded,
    and of the eager model given its weights (its buffers its own), both
    on ``device``."""
    on = devices.init_process_group(device)
    with torch.device("meta"):
        model = MODELS[name]()
    engine, *_ = zcore.initialize(model=model, config=stage3_config(world), meta_init=zcore.MetaInit(seed=3))
    devices.assert_on(engine, device)
    engine.eval()
    prompt = torch.tensor(PROMPT, device=on)
    settings = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    got = engine.module.generate(prompt, **settings)
    eager = MODELS[name]().eval()
    eager.load_state_dict(engine.full_state_dict())
    expected = eager.to(on).generate(prompt, **settings)
    return got.tolist(), expected.tolist()


@pytest.mark.device
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_model_built_on_meta_generates_as_the_eager_model_with_its_weights(name, device):
    got, expected = run_ranks(generated_after_meta_init, 1, name, device, launcher=False, timeout=TIMEOUT)[0]
    assert [len(row) for row in got] == [len(PROMPT[0]) + 6] * len(PROMPT)
    assert got == expected


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.proj = nn.Linear(64, 64)
        self.register_buffer("offsets", torch.zeros(64))  # under torch.device("meta"): no values


def drawn_per_rank(module):
    # Each rank draws something else: every rank must end with rank 0's values.
    rank = torch.distributed.get_rank()
    if isinstance(module, nn.Linear):
        module.weight.normal_(generator=torch.Generator().manual_seed(rank))
    if isinstance(module, TwoLayers):
        module.offsets.fill_(rank)


def zeros_a_childs_row(module):
    if isinstance(module, TwoLayers):
        # A parent reaching into a child that is, when this runs, either not
        # materialised yet or sharded and released (either way, zcore shows it
        # a meta tensor of its full shape).
        nn.init.zeros_(module.embed.weight[5])
        module.offsets.zero_()


def built_with(rank, world, init_fn):
    with torch.device("meta"):
        model = TwoLayers()
    meta_init = zcore.MetaInit(init_fn=init_fn)
    engine, *_ = zcore.initialize(model=model, config=stage3_config(world), meta_init=meta_init)
    return engine.full_state_dict(), model.offsets.clone()


def test_every_rank_takes_rank_0s_values():
    results = run_ranks(built_with, 2, drawn_per_rank, timeout=TIMEOUT)
    rank0 = torch.empty(64, 64).normal_(generator=torch.Generator().manual_seed(0))
    assert torch.equal(results[0][0]["proj.weight"], rank0)  # not half of it rank 1's draws
    for _, offsets in results:
        assert torch.equal(offsets, torch.zeros(64))


def test_a_parents_init_reaches_its_childs_weight():
    values, _ = run_ranks(built_with, 2, zeros_a_childs_row, timeout=TIMEOUT)[0]
    rows = values["embed.weight"].abs().sum(dim=1)
    assert rows[5] == 0 and rows.count_nonzero() == 31


class UnsetBuffer(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scales = nn.Module()
        self.scales.register_buffer("table", torch.arange(4, dtype=dtype))  # under torch.device("meta"): no values


def unset_buffer(rank, world, dtype):
    with torch.device("meta"):
        model = UnsetBuffer(dtype)
    try:
        zcore.initialize(model=model, config=stage3_config(world), meta_init=zcore.MetaInit())
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])  # an integer one cannot be marked unset
def test_a_meta_buffer_that_nothing_sets_is_refused(dtype):
    for message in run_ranks(unset_buffer, 2, dtype, timeout=TIMEOUT):  # on every rank, none left waiting
        assert message is not None and "'scales.table'" in message
        assert "init_fn" in message and "CPU" in message
