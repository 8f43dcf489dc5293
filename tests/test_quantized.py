"""Weight-only quantized layers (server/model/quantized.py) and a GGUF's tensors served as they are.

The kernels are held to bounds derived from the formats (bf16 scales, zeros, activations and outputs:
`output_error_bound`), against the dequantized weights in float64; a row's result must not depend on the rows
it is batched with; GGUF blocks must decode to ggml's own reference; and the engine on a quantized model must
keep greedy output identical across proposers and batch compositions.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from server.config import Settings
from server.model import cpu_kernels
from server.model.attention import WIDE, use_gqa_attention
from server.model.fusion import fused
from server.model.loading import load_model, resolve_weights
from server.model.prefix_cache import BLOCK, PrefixCache
from server.model.quantize import quantize_linears
from server.model.quantized import GROUP, Int8Linear, Q4Linear, Q8Linear, has_int4_kernel, output_error_bound
from server.model.runner import ModelRunner
from server.model.tables import BlockTable, Fp16Table, TableHead
from server.model.weights_cache import entry_path
from tests.engine_helpers import request, run, run_with_stats
from tests.models import as_loaded, perturbed, tiny_llama, write_tiny_gguf

pytestmark = pytest.mark.skipif(not has_int4_kernel(), reason="this torch has no CPU int4 kernel")

OUT, IN = 96, 128  # out a multiple of 16 (the kernel's column blocks), in of 32 (ggml's blocks)


def _random_layer(kind: str, seed: int = 0, out: int = OUT, inputs: int = IN) -> Q4Linear | Q8Linear | Int8Linear:
    """A layer from random blocks as a file holds them: fp16 scales (and minimums), random quantized values."""
    g = torch.Generator().manual_seed(seed)
    groups = inputs // GROUP
    d = (torch.rand(out, groups, generator=g) * 0.02 + 0.001).half().float()
    if kind in ("Q4_0", "Q4_1"):
        q = torch.randint(0, 16, (out, inputs), generator=g, dtype=torch.int32)
        m = (-8 * d * (1 + 0.2 * torch.randn(out, groups, generator=g))).half().float() if kind == "Q4_1" else None
        return Q4Linear.from_blocks(q, d, m)
    if kind == "Q8_0":
        return Q8Linear(torch.randint(-127, 128, (out, inputs), generator=g, dtype=torch.int8), d)
    return Int8Linear.quantize(torch.randn(out, inputs, generator=g) * 0.05)


@pytest.fixture(scope="module", params=["float32", "int8", "torch-int4"])
def backend(request):
    """Which kernel the block layers built in a test multiply through: the float32 block kernels (cpu_kernels.py,
    where they build) on float32 activations or, Q4 blocks, on int8 ones (`SPECULA_INT8_ACTIVATIONS`), or torch's
    int4 kernel (bf16 activations; `SPECULA_CPU_KERNELS=0`)."""
    if request.param != "torch-int4" and cpu_kernels.library() is None:
        if os.environ.get("CI"):  # CI installs a compiler: the kernels must build there
            pytest.fail("the float32 block kernels did not build (see the log for why)")
        pytest.skip("the float32 block kernels do not build here")
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "torch-int4":
            patch.setattr(cpu_kernels, "library", lambda: None)
        patch.setenv("SPECULA_INT8_ACTIVATIONS", "1" if request.param == "int8" else "0")
        yield request.param


def _x(rows: int, inputs: int = IN, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)) * 2


def test_q4_1_is_the_int4_kernels_scale_and_zero_exactly():
    """ggml's Q4_1 weight d q + m is the kernel's s (q - 8) + z with s = d, z = m + 8d: equal up to the fp32
    rounding of z and of the sum (a few units in the last place of |m| + 8|d| + |d q|)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.int32)
    d = (torch.rand(OUT, IN // GROUP, generator=g) * 0.05).half().float()
    m = (torch.randn(OUT, IN // GROUP, generator=g) * 0.2).half().float()
    layer = Q4Linear.from_blocks(q, d, m)
    dd, mm = d.repeat_interleave(GROUP, 1), m.repeat_interleave(GROUP, 1)
    ggml = dd * q + mm
    ulps = 4 * torch.finfo(torch.float32).eps * (mm.abs() + 8 * dd + (dd * q).abs())
    assert ((layer.dequantize() - ggml).abs() <= ulps).all()
    assert torch.equal(layer.scales_zeros[..., 0], d.t())  # s = d, stored in the kernel's [in/32, out, 2]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8"])
def test_kernel_matches_the_dequantized_weights_within_the_formats_bound(kind, backend):
    layer = _random_layer(kind)
    x = _x(7)
    got = layer.kernel()(x).double()
    exact = x.double() @ layer.dequantize().double().t()
    bound = output_error_bound(layer, x)
    assert ((got - exact).abs() <= bound).all(), float(((got - exact).abs() - bound).max())
    # the bound says something: bf16-sized (int8 activations: the worst case of half a step on every input, 8%)
    assert float(bound.max()) < (0.1 if layer.int8_activations() else 0.05) * float(exact.abs().max())
    if layer.rounds_inputs():
        assert got.dtype == torch.float64 and (got - exact).abs().max() > 1e-4 * exact.abs().max()  # bf16 shows
    else:  # the block kernels: float32-sized (int8-sized on int8 activations), on every shape, rows not a
        # multiple of 4 and outputs of 16
        assert layer.int8_activations() == (backend == "int8" and kind != "int8")
        if layer.int8_activations():
            assert (got - exact).abs().max() > 1e-4 * exact.abs().max()  # the activations' rounding shows
        else:
            assert kind != "int8" and float(bound.max()) < 1e-4 * float(exact.abs().max())
        odd = _random_layer(kind, out=40, inputs=96)
        xs = _x(5, inputs=96)
        err = (odd.kernel()(xs).double() - xs.double() @ odd.dequantize().double().t()).abs()
        assert (err <= output_error_bound(odd, xs)).all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8", "table", "fused"])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(kind, backend):
    """Weights only are quantized: a row's output is the same bits alone, among 9 rows, or among others."""
    if kind == "table":
        call = TableHead(Fp16Table(torch.randn(OUT * 5, IN) * 0.05)).kernel()
    elif kind == "fused":
        call = fused([_random_layer("Q4_1", seed) for seed in range(3)])
    else:
        call = _random_layer(kind).kernel()
    rows = _x(9)
    together = call(rows)
    for i in range(9):
        assert torch.equal(call(rows[i : i + 1]), together[i : i + 1])
    others = torch.cat([_x(4, seed=7), rows[3:4], _x(2, seed=8)])
    assert torch.equal(call(others)[4], together[3])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_fused_layers_give_each_layers_own_results(kind, backend):
    layers = [_random_layer(kind, seed, out=out) for seed, out in enumerate((96, 32, 32))]
    x = _x(5)
    joined = fused(layers)(x)
    assert torch.equal(joined, torch.cat([layer.kernel()(x) for layer in layers], dim=-1))


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_file_served_as_it_is(tmp_path, quant):
    """A tiny GGUF in each type: linear layers stay quantized, the Q8_0 table stays Q8_0 blocks (the input
    embeddings and the tied LM head), the dequantized weights and the table's rows equal transformers'
    dequantization of the same file (q/k permutation undone), and the logits agree with the fp32 model."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant=quant)
    served = load_model(str(path), device="cpu", weights="as-file")
    dense = load_model(str(path), device="cpu", weights="fp32").model
    model = served.model
    assert served.weights == "as-file" and model.dtype == torch.float32
    want = Q8Linear if quant == "Q8_0" else Q4Linear
    reference = dict(dense.named_modules())
    for name, module in model.named_modules():
        if name.endswith(("_proj",)):
            assert type(module) is want, name
            assert torch.equal(module.dequantize(), reference[name].weight), name
    assert isinstance(model.lm_head, TableHead) and model.lm_head.table is model.get_input_embeddings()
    table = model.get_input_embeddings()
    assert isinstance(table, BlockTable) and table.qweight.dtype == torch.int8
    assert torch.equal(table.dequantize(), dense.get_input_embeddings().weight)
    ids = torch.tensor([[5, 17, 40, 99, 120, 3, 77, 8]])
    with torch.no_grad():
        got, want_logits = model(ids).logits, dense(ids).logits
    assert (got - want_logits).abs().max() < 0.1 * want_logits.abs().max()


def test_a_q8_table_head_gives_the_files_logits_within_the_formats_bound(backend):
    """The LM head over a Q8_0 table: the float32 block kernel (or, without it, fbgemm's fp16 GEMM of its values)
    against the dequantized table in float64; a row's logits the same bits beside any rows; lookups exact."""
    layer = _random_layer("Q8_0", out=160, inputs=IN)
    table = BlockTable(layer.qweight, layer.scales)
    head = TableHead(table)
    x = _x(7)
    got = head(x).double()
    want = x.double() @ table.dequantize().double().t()
    if backend != "torch-int4":
        assert (got - want).abs().le(output_error_bound(layer, x)).all()
    else:  # fp16 values: 2^-11 of each weight
        assert torch.allclose(got, want, rtol=0, atol=2.0**-10 * float((x.abs() @ layer.dequantize().abs().t()).max()))
    assert torch.equal(head(x[3:4]), head(x)[3:4])
    ids = torch.tensor([[3, 150], [7, 0]])
    assert torch.equal(table(ids), layer.dequantize()[ids])
    if backend != "torch-int4":  # a server drops the table's own blocks: lookups read the head kernel's
        assert sum(t.numel() for t in table.release()) == layer.qweight.numel() + layer.scales.numel()
        assert table.qweight.numel() == 0 and torch.equal(table(ids), layer.dequantize()[ids])
    with pytest.raises(AttributeError):
        head.weight  # noqa: B018  no dense copy is built behind a caller's back


def test_an_fp16_table_head_gives_its_values_logits_and_a_tied_table_is_held_once(backend):
    """An fp16 table (a file's F16 embeddings, a checkpoint's head under int8) as the LM head: the float32 kernels'
    fp16 tiles (or fbgemm's fp16 GEMM) against the same values in float64, a row's logits the same bits beside any
    rows (fbgemm alone sums a row differently by call size on AVX2 hosts); once the server drops the table's own
    values, lookups read the tiles and give the same rows."""
    values = (torch.randn(OUT + 8, IN, generator=torch.Generator().manual_seed(4)) * 0.05).half()
    table = Fp16Table(values)
    head = TableHead(table)
    x = _x(9)
    got = head(x)
    want = x.double() @ values.double().t()
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float((x.abs() @ values.float().abs().t()).max()))
    for rows in ([3], [3, 4], [0, 3, 5, 6, 7, 8, 1]):  # alone, in 2, in 7: the sizes fbgemm sums differently
        assert torch.equal(head(x[rows])[rows.index(3)], got[3])
    ids = torch.tensor([[3, OUT + 7], [0, 50]])
    assert torch.equal(table(ids), values[ids].float())
    dropped = table.release()
    if backend != "torch-int4":  # the tiles hold the values: the table's own copy goes
        assert [t.numel() for t in dropped] == [values.numel()] and table.weight.numel() == 0
    assert torch.equal(table(ids), values[ids].float()) and torch.equal(head(x), got)


@pytest.mark.slow
def test_weights_cache_has_an_entry_per_format(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q4_1")
    cache = tmp_path / "cache"
    first = load_model(str(path), device="cpu", cache_dir=cache, weights="as-file").model
    again = load_model(str(path), device="cpu", cache_dir=cache, weights="as-file").model  # from the entry
    load_model(str(path), device="cpu", cache_dir=cache, weights="fp32")
    quantized, dequantized = entry_path(path, cache, "as-file"), entry_path(path, cache, "fp32")
    assert quantized != dequantized
    assert (quantized / "quantized.safetensors").is_file() and (quantized / "specula-cache.json").is_file()
    assert (dequantized / "model.safetensors").is_file()
    ids = torch.tensor([[5, 17, 40, 99]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, again(ids).logits)
    assert entry_path(path, cache, "bf16") == dequantized  # bf16 and int8 start from the fp32 entry


def test_which_weights_are_served():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # a GGUF on CPU: its blocks as they are where the float32 kernels build, else dense (float64 attention
    # would make its prompts cost 1.4-1.7x more)
    floats = cpu_kernels.library() is not None
    assert resolve_weights("auto", gguf=True, device=cpu, dtype=torch.float32) == ("as-file" if floats else "fp32")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "library", lambda: None)
        assert resolve_weights("auto", gguf=True, device=cpu, dtype=torch.float32) == "fp32"
    assert resolve_weights("auto", gguf=True, device=cpu, dtype=torch.bfloat16) == "bf16"  # a dtype asked for
    assert resolve_weights("as-file", gguf=True, device=cpu, dtype=torch.float32) == "as-file"
    assert resolve_weights("auto", gguf=False, device=cpu, dtype=torch.float32) == "fp32"
    assert resolve_weights("auto", gguf=True, device=cuda, dtype=torch.bfloat16) == "bf16"
    assert resolve_weights("as-file", gguf=True, device=cuda, dtype=torch.bfloat16) == "bf16"  # CPU kernels only
    assert resolve_weights("as-file", gguf=False, device=cpu, dtype=torch.float32) == "fp32"
    assert resolve_weights("int8", gguf=False, device=cpu, dtype=torch.float32) == "int8"
    with pytest.raises(ValueError):
        resolve_weights("q4", gguf=True, device=cpu, dtype=torch.float32)


def test_int8_weights_for_a_checkpoint(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=3, hidden=64)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", weights="int8")
    assert loaded.weights == "int8"
    assert all(type(m) is Int8Linear for n, m in loaded.model.named_modules() if n.endswith("_proj"))
    assert isinstance(loaded.model.lm_head, TableHead)  # fp32 logits from fp16 weights


def test_int8_loading_hands_the_replaced_dense_weights_back_to_the_kernel(tmp_path, tokenizer, monkeypatch):
    """Read zero-copy from a safetensors file, the dense weights int8 layers replace would stay resident while
    anything else of the file is mapped (SmolLM2's float32 entry: RSS 956 MiB after loading, 444 with this): every
    replaced weight's pages are dropped, and none that the model still reads."""
    from server.model import loading

    model = tiny_llama(len(tokenizer), seed=3, hidden=64)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    dropped: list[torch.Tensor] = []
    monkeypatch.setattr(loading, "drop_file_pages", lambda tensors: dropped.extend(tensors) or 0)
    loaded = load_model(str(tmp_path), device="cpu", weights="int8").model
    replaced = [n for n, m in loaded.named_modules() if type(m) is Int8Linear]
    assert replaced and len(dropped) == len(replaced) + 1  # every projection, and the LM head (now a table)
    kept = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for t in (*loaded.parameters(), *loaded.buffers()) if t.numel()]
    for t in dropped:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert not any(lo < end and start < hi for lo, hi in kept)


# ---- the engine on a quantized model ------------------------------------------------------------------


def _quantized(model: nn.Module, kind: str) -> nn.Module:
    quantize_linears(model, kind)
    return model


@pytest.fixture(scope="module")
def quantized_pair(tokenizer, backend):
    target = tiny_llama(len(tokenizer), seed=0)
    draft = perturbed(target, 0.05)
    target_q = as_loaded(_quantized(target, "q4"), tokenizer, "tiny-q4")
    target_q.weights = "as-file"
    return target_q, as_loaded(_quantized(draft, "q8"), tokenizer, "tiny-q8-draft")


@pytest.fixture(scope="module")
def quantized_reference(quantized_pair, prompt_ids):
    from server.engine.engine import Engine

    target, _ = quantized_pair
    out = {}
    for i, p in enumerate(prompt_ids):
        out.update(run(Engine(target, None, Settings.load()), [request(f"r{i}", p)]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_output_on_a_quantized_target_is_the_same_for_every_proposer(
    quantized_pair, quantized_reference, prompt_ids, method
):
    from server.engine.engine import Engine

    engine = Engine(*quantized_pair, Settings.load())
    assert engine.runner.call.fused[0] is not None  # the quantized kernels, fused, are what runs
    out = run(engine, [request(f"r{i}", p, method, 3) for i, p in enumerate(prompt_ids)])
    assert out == quantized_reference


def test_a_position_gets_the_same_logits_in_a_call_of_any_width_on_a_quantized_target(
    quantized_pair, tiny_target, backend
):
    """torch's int4 kernel rounds its inputs to bfloat16, so attention's last bits would reach the logits: a model
    on it attends in float64 (attention.py), and a position's logits are the same bits fed one token at a time
    beside a longer row as fed within a 10-token pass alone. On the block kernels nothing is rounded to bfloat16:
    the model keeps float32 attention, and every pass runs the C decoder, the same bits in any pass
    (test_cpu_decoder.py). A dense model on CPU attends in float64 (attention.py)."""
    model = quantized_pair[0].model
    use_gqa_attention(model)
    rounds = backend == "torch-int4"
    assert all(getattr(m, WIDE) == rounds for m in model.modules() if hasattr(m, "q_proj"))
    use_gqa_attention(tiny_target.model)  # dense on CPU: float64 too (SDPA's float32 moves with the pass on AVX2)
    assert all(getattr(m, WIDE) for m in tiny_target.model.modules() if hasattr(m, "q_proj"))
    tokens = [(37 * i) % 900 + 50 for i in range(40)]
    one = ModelRunner(model)
    one.join(["a", "long"], [tokens[:30], [(11 * i) % 700 + 60 for i in range(90)]])
    singly = torch.cat([one.forward([[t], [7]]).logits[0, :1] for t in tokens[30:]])
    wide = ModelRunner(model)
    wide.join(["a"], [tokens[:30]])
    together = wide.forward([tokens[30:]]).logits[0]
    assert torch.equal(singly, together)


def test_mixed_methods_in_one_batch_on_a_quantized_target(quantized_pair, quantized_reference, prompt_ids):
    from server.engine.engine import Engine

    methods = ["none", "ngram", "draft", "suffix", "draft"]
    requests = [request(f"r{i}", p, m, 1 + i) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    assert run(Engine(*quantized_pair, Settings.load()), requests) == quantized_reference


# ---- what is keyed by the weights format -----------------------------------------------------------------


def test_calibration_and_prefix_cache_keys_name_the_weights_format_and_the_caches_precision(
    quantized_pair, tiny_target, backend
):
    from server.engine.calibration import Subject, cache_path
    from server.engine.engine import Engine

    settings = Settings.load()
    quantized, dense = Engine(quantized_pair[0], None, settings), Engine(tiny_target, None, settings)
    wide = Engine(quantized_pair[0], None, Settings.load(kv_cache_dtype="float32"))

    def key(engine: Engine) -> dict[str, object]:
        return Subject(engine.target, engine.runner, engine.planner.proposers, settings).key()

    assert key(quantized)["weights"] == "as-file"
    assert key(dense)["weights"] == "fp32"
    assert cache_path(settings.cache_dir, key(quantized)) != cache_path(settings.cache_dir, key(dense))
    assert cache_path(settings.cache_dir, key(quantized)) != cache_path(settings.cache_dir, key(wide))
    # auto: a quantized target's keys and values in float16 (llama.cpp's cache), a dense one's as computed
    assert (quantized.kv_cache_dtype, wide.kv_cache_dtype, dense.kv_cache_dtype) == ("float16", "float32", "float32")
    act = quantized.activations  # int8 or float32 by the backend (bfloat16 on torch's int4 kernel)
    assert act == {"int8": "int8", "float32": "float32", "torch-int4": "bfloat16"}[backend]
    assert quantized.admission.prefixes.namespace.endswith(f":as-file:{act}:kv-float16")
    assert wide.admission.prefixes.namespace.endswith(f":as-file:{act}:kv-float32")
    assert dense.admission.prefixes.namespace.endswith(":fp32:float32:kv-float32")
    tokens = list(range(40))
    names = [PrefixCache(1 << 20, namespace=ns).names(tokens, None) for ns in ("m:as-file", "m:fp32", "m:as-file")]
    assert names[0] != names[1] and names[0] == names[2]


def test_a_quantized_targets_prefix_cache_keeps_float16_blocks_that_give_the_same_text(
    quantized_pair, quantized_reference, prompt_ids
):
    """auto keeps a quantized target's keys and values in float16: every value the cache holds is one, the prefix
    cache stores its blocks in float16 (half float32's bytes, nothing lost), and a prompt read back from them
    continues exactly as the same prompt computed (greedy, every proposer's rows compared the same way)."""
    from server.engine.engine import Engine

    engine = Engine(quantized_pair[0], None, Settings.load())
    prompt = max(prompt_ids, key=len)
    name = f"r{prompt_ids.index(prompt)}"
    first = run_with_stats(engine, [request("cold", prompt)])
    blocks = list(engine.admission.prefixes._blocks.values())
    assert blocks and all(b.keys.dtype == b.values.dtype == torch.float16 for b in blocks)
    shape = engine.runner.kv_shape(engine.target.model)
    per_block = shape.bytes_per_token * BLOCK // 2 + sum(
        b.features.numel() * 4 if b.features is not None else 0 for b in blocks[:1])
    assert blocks[0].nbytes == per_block
    again = run_with_stats(engine, [request("warm", prompt, "ngram", 3)])
    assert again[1]["warm"].cached_tokens >= BLOCK
    assert first[0]["cold"] == again[0]["warm"] == quantized_reference[name]


def test_the_prefix_cache_keeps_the_features_a_bf16_head_reads_in_bf16_and_it_drafts_the_same(
    quantized_pair, prompt_ids, tmp_path
):
    """A quantized target's EAGLE head runs in bf16 on CPU and rounds every feature to bf16 first: the prefix cache
    keeps them so (half the bytes), and a prompt whose prefix comes back from it drafts and accepts exactly as
    the same prompt computed."""
    from server.draft_head.model import EagleHead
    from server.engine.engine import Engine

    target = quantized_pair[0]
    head = EagleHead.create(target.model, list(range(0, target.model.config.vocab_size, 2)), "tiny-q4", seed=1)
    assert head.fc.weight.dtype == torch.bfloat16
    head.save_pretrained(tmp_path, dtype=torch.bfloat16)
    settings = Settings.load(draft_head=str(tmp_path))
    shared = prompt_ids[3] + prompt_ids[4]
    engine = Engine(target, None, settings)
    run(engine, [request("a", shared + prompt_ids[1], "eagle", 4, max_tokens=12)])
    blocks = list(engine.admission.prefixes._blocks.values())
    assert blocks and all(b.features is not None and b.features.dtype == torch.bfloat16 for b in blocks)
    turn = shared + prompt_ids[2]
    warm = run_with_stats(engine, [request("b", turn, "eagle", 4, max_tokens=24)])
    cold = run_with_stats(Engine(target, None, Settings.load(draft_head=str(tmp_path), prefix_cache_memory="none")),
                          [request("b", turn, "eagle", 4, max_tokens=24)])
    assert warm[1]["b"].cached_tokens >= BLOCK
    assert warm[0] == cold[0]
    assert (warm[1]["b"].draft_tokens, warm[1]["b"].accepted_tokens) == \
        (cold[1]["b"].draft_tokens, cold[1]["b"].accepted_tokens)


def test_a_servers_quantized_weights_are_counted_once_their_buffers_are_dropped(tokenizer, backend):
    """`specula_memory_bytes{part="weights"}` counts what the kernels hold once the layers' own buffers are
    dropped (a server's model): about the file's bytes, not only the embedding table."""
    from server.model.memory import tensor_bytes

    model = _quantized(tiny_llama(len(tokenizer), seed=3), "q4")
    layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
    held = sum(m.qweight.numel() for m in layers)  # bytes of the 4-bit values alone
    use_gqa_attention(model)
    runner = ModelRunner(model)
    runner.release_dense()
    assert all(b.numel() == 0 for m in layers for b in m.buffers())
    counted = tensor_bytes(runner.weight_tensors(), set())
    kernels = counted - tensor_bytes([*model.parameters(), *model.buffers()], set())
    assert kernels >= held  # the kernels' copies (values, scales) are counted where the buffers were


def test_the_start_up_log_names_the_kernel_each_block_layer_runs(tokenizer, backend):
    from server.model.loading import describe_weights

    model = _quantized(tiny_llama(len(tokenizer), seed=4), "q4")
    kernel = {"torch-int4": "bf16 kernel", "float32": "float32 kernel", "int8": "int8 activations"}[backend]
    assert f"q4 ({kernel})" in describe_weights(model, "as-file")
