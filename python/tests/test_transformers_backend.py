"""experts_implementation="moefuse" in Hugging Face transformers (moefuse.integrations.transformers):
small random models of five MoE families give eager's logits and greedy tokens in f32, and in bf16
each experts call is closer to its f32 value than eager's is. Skipped,
with the reason, without torch or without a transformers that takes registered experts backends.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch_devices import DEVICES  # noqa: E402

import moefuse  # noqa: E402

try:
    from transformers.integrations import moe as hf_moe
except ImportError:  # transformers 4: no experts interface
    hf_moe = None


def _takes_registered_names():
    # transformers 5.0 accepted only its own names; later releases accept any registered one
    if hf_moe is None or not hasattr(hf_moe, "ExpertsInterface"):
        return False
    import inspect

    from transformers import modeling_utils
    source = inspect.getsource(modeling_utils.PreTrainedModel.get_correct_experts_implementation)
    return "ALL_EXPERTS_FUNCTIONS" in source


pytestmark = pytest.mark.skipif(not _takes_registered_names(),
                                reason="this transformers has no registered experts backends")

if _takes_registered_names():
    from moefuse.integrations import transformers as mf_transformers

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)

# name -> (config class name, its keywords): each family's experts module, a few experts
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, head_dim=16,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4,
                                      num_experts_per_tok=2, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=32,
                                             n_routed_experts=8, n_shared_experts=1,
                                             num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, num_key_value_heads=4,
                                             q_lora_rank=None, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=16)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=4,
                                     num_experts_per_tok=2, head_dim=16, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"])),
}


def _model(family, dtype, device, **extra):
    cls_name, kw = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **kw, **extra})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # every expert weight and bias random, not the init's zeros
        for name, p in model.named_parameters():
            if ".experts." in name or "router" in name or ".gate." in name:
                p.normal_(0.0, 0.5 if "bias" in name else 0.08)
    return model.to(device).eval()


@pytest.fixture
def calls(monkeypatch):
    """How many times transformers called moefuse's experts function (so a test cannot pass on
    eager's own path)."""
    seen = []

    def spy_on(forward):
        def spy(*args, **kwargs):
            seen.append(1)
            return forward(*args, **kwargs)
        return spy

    monkeypatch.setitem(hf_moe.ExpertsInterface._global_mapping, mf_transformers.NAME,
                        spy_on(mf_transformers.experts_forward))
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:
        return seen
    monkeypatch.setitem(finegrained_fp8.FP8ExpertsInterface._global_mapping, mf_transformers.NAME,
                        spy_on(mf_transformers.fp8_experts_forward))
    return seen


def _logits(model, ids, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_as_eager(family, device, calls):
    model = _model(family, torch.float32, device)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7)).to(device)
    want = _logits(model, ids, "eager")
    assert not calls
    got = _logits(model, ids, mf_transformers.NAME)
    assert len(calls) == sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))
    # both sum in f32, in other orders
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    assert err < 2e-4, f"{family}: relative error {err:.2e}"
    # the moefuse call left the weights' values alone (a transposed layout is laid out in place:
    # eager's GEMMs may then sum in another order, so its result is equal up to rounding)
    again = _logits(model, ids, "eager")
    assert (again - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_experts_closer_to_f32_than_eager(family, device, calls):
    """bf16, layer by layer: each experts call of an eager run, on the same inputs, through
    moefuse, against the same call in f32 on the same bf16 values. (Whole-model bf16 logits
    cannot be compared: one layer's rounding can flip the next layer's top-k, and then the two
    runs take other experts.) Both round h to bf16; eager also rounds the gate-up product and each
    expert's output, and sums the experts in bf16, where moefuse keeps f32 until the output."""
    model = _model(family, torch.bfloat16, device)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7)).to(device)
    seen = []

    def keep(module, args, output):
        seen.append((module, [a.detach().clone() for a in args], output.detach().clone()))

    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    hooks = [m.register_forward_hook(keep) for m in experts]
    try:
        _logits(model, ids, "eager")
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(experts) and not calls
    for module, (x, top_k, weights), eager_out in seen:
        with torch.no_grad():
            got = mf_transformers.experts_forward(module, x, top_k, weights)
            f32 = copy.deepcopy(module).float()
            want = f32(x.float(), top_k, weights.float())
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        scale = max(want.norm().item(), 1e-6)  # relative 2-norms: steadier than one element
        err = (got.float() - want).norm().item() / scale
        eager_err = (eager_out.float() - want).norm().item() / scale
        assert err <= eager_err, f"{family}: moefuse {err:.2e} > eager {eager_err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_as_eager(family, device, calls):
    model = _model(family, torch.float32, device)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3)).to(device)

    def generate(impl):
        model.set_experts_implementation(impl)
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                  pad_token_id=0)

    assert torch.equal(generate(mf_transformers.NAME), generate("eager"))
    assert calls


def test_unsupported_activation_is_refused():
    model = _model("mixtral", torch.float32, "cpu", hidden_act="relu")
    ids = torch.zeros((1, 3), dtype=torch.long)
    model.set_experts_implementation(mf_transformers.NAME)
    with pytest.raises(moefuse.UnsupportedError, match="ReLU"):
        with torch.no_grad():
            model(ids)


def test_expert_parallel_sentinel_contributes_nothing():
    model = _model("qwen3_moe", torch.float32, "cpu")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(4, 64)
    ids = torch.tensor([[0, 3], [8, 1], [2, 8], [8, 8]])  # 8: transformers' EP sentinel
    w = torch.rand(4, 2)
    got = mf_transformers.experts_forward(experts, x, ids, w)
    keep = (ids < 8).float()
    want = mf_transformers.experts_forward(experts, x, ids.clamp(max=7), w * keep)
    assert torch.allclose(got, want, rtol=0, atol=0)
    assert torch.count_nonzero(got[3]) == 0


def test_prepare_lays_out_transposed_weights_once():
    model = _model("gpt_oss", torch.float32, "cpu")
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    mf_transformers.prepare(model)
    assert experts.gate_up_proj.transpose(1, 2).stride(2) == 1
    assert experts.gate_up_proj.shape == before.shape
    assert torch.equal(experts.gate_up_proj, before)
    ptr = experts.gate_up_proj.data_ptr()
    mf_transformers.prepare(model)  # already dense: nothing moves
    assert experts.gate_up_proj.data_ptr() == ptr


# ------------------------------------------------------------------ fine-grained FP8


def _quantize_blocks(w):
    """w [E, N, K] f32 -> e4m3 codes and one f32 scale per 128 x 128 block [E, N/128, K/128]."""
    e, n, k = w.shape
    blocks = w.reshape(e, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, scale


def _dequantize_blocks(q, scale):
    return q.float() * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)


def test_fp8_experts_read_the_blocks_as_transformers_lays_them():
    finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    E, K, I, T, k = 4, 256, 256, 6, 2
    config = transformers.MixtralConfig(hidden_size=K, intermediate_size=I, num_local_experts=E)
    experts = finegrained_fp8.FP8Experts(config, block_size=(128, 128))
    g = torch.Generator().manual_seed(5)
    q1, s1 = _quantize_blocks(torch.randn(E, 2 * I, K, generator=g) * 0.05)
    q2, s2 = _quantize_blocks(torch.randn(E, K, I, generator=g) * 0.05)
    with torch.no_grad():
        experts.gate_up_proj.copy_(q1)
        experts.gate_up_proj_scale_inv.copy_(s1)
        experts.down_proj.copy_(q2)
        experts.down_proj_scale_inv.copy_(s2)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1], [0, 2]])
    w = torch.rand(T, k, generator=g)
    got = mf_transformers.fp8_experts_forward(experts, x, ids, w).float()
    # the float layer on the dequantized weights; moefuse also quantizes x and h to FP8
    w1, w2 = _dequantize_blocks(q1, s1), _dequantize_blocks(q2, s2)
    want = torch.zeros(T, K)
    for t in range(T):
        for j in range(k):
            gu = w1[ids[t, j]] @ x[t].float()
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            want[t] += w[t, j] * (w2[ids[t, j]] @ h)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 6e-2, f"relative error {err:.2e}"
    experts.activation_scheme = "static"
    with pytest.raises(moefuse.UnsupportedError, match="static"):
        mf_transformers.fp8_experts_forward(experts, x, ids, w)


@pytest.mark.parametrize("device", [p for p in DEVICES if p != "cpu"])
def test_fp8_model_as_transformers_fp8(device, tmp_path, calls):
    """A fine-grained FP8 Qwen3-MoE against transformers' own FP8 experts (grouped_mm)."""
    model = _model("qwen3_moe", torch.bfloat16, "cpu", hidden_size=256, moe_intermediate_size=128,
                   intermediate_size=256, head_dim=64)
    model.save_pretrained(tmp_path)
    quant = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    fp8 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map=device).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11)).to(device)
    try:
        want = _logits(fp8, ids, "grouped_mm")
    except ImportError as e:  # its FP8 linears load their kernels from the hub
        pytest.skip(f"transformers' own FP8 model does not run here: {e}")
    got = _logits(fp8, ids, mf_transformers.NAME)
    assert calls
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 6e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("device", [p for p in DEVICES if p != "cpu"])
def test_fp8_experts_read_what_transformers_quantized(device, tmp_path):
    """A model that transformers quantized to fine-grained FP8 on load (the experts only, so that
    nothing else needs its hub kernels; its dequantize=True load fails on 3-D experts in 5.17):
    the blocks, dequantized as the layout says, are the bf16 weights it quantized; and each experts
    call of the bf16 model's eager run, on its inputs, through moefuse's FP8 experts, is the f32
    layer on those dequantized weights, up to moefuse's FP8 x and h."""
    model = _model("qwen3_moe", torch.bfloat16, "cpu", hidden_size=256, moe_intermediate_size=128,
                   intermediate_size=256, head_dim=64)
    model.save_pretrained(tmp_path)
    quant = transformers.FineGrainedFP8Config(weight_block_size=(128, 128),
                                              modules_to_not_convert=["self_attn", "gate", "lm_head"])
    fp8 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map=device)
    model = model.to(device)
    quantized = [m for m in fp8.modules() if hasattr(m, "gate_up_proj")]
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert len(quantized) == len(experts) > 0
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, o: seen.append([x.detach() for x in a]))
             for m in experts]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11)).to(device)
    try:
        _logits(model, ids, "eager")
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(experts)
    for (x, top_k, weights), q, module in zip(seen, quantized, experts):
        assert q.gate_up_proj.dtype == torch.float8_e4m3fn
        f32 = copy.deepcopy(module).float()
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                w = _dequantize_blocks(getattr(q, name).cpu(), getattr(q, name + "_scale_inv").cpu())
                orig = getattr(module, name).float().cpu()
                assert (w - orig).norm() <= 5e-2 * orig.norm(), name  # e4m3: a few % a value
                getattr(f32, name).copy_(w)
            got = mf_transformers.fp8_experts_forward(q, x, top_k, weights).float()
            want = f32(x.float(), top_k, weights.float())
        err = (got - want).norm().item() / want.norm().item()
        assert err < 6e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_traces_under_torch_compile_in_one_graph(family):
    model = _model(family, torch.float32, "cpu")
    model.set_experts_implementation(mf_transformers.NAME)
    mf_transformers.prepare(model)
    experts = model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 64, generator=g), torch.rand(5, 2, generator=g)
    ids = torch.randint(0, 4, (5, 2), generator=g)
    compiled = torch.compile(lambda a, b, c: experts(a, b, c), backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, ids, w), experts(x, ids, w))
