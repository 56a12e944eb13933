"""Document masking (`seq_idx`, model/documents.py): a packed row of documents of uneven lengths gives every
document the logits, MTP logits and parameter gradients it gets alone in its row (fp32); the fast paths equal
their references forward and backward (the masked chunked scan and `ssd_ref`, the masked conv and scan and
`mamba2_mixer_ref`, per-document attention and the dense-mask `attention_ref`); attention never runs a call over
more keys than a document holds; compiled blocks give the eager numbers; a bad seq_idx is one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.model import attention as attention_module
from hybridtron.model.attention import Attention, attention_ref
from hybridtron.model.documents import check_seq_idx, document_spans
from hybridtron.model.lm import HybridLM
from hybridtron.model.mamba2 import Mamba2Mixer, mamba2_mixer_ref
from hybridtron.model.state import LayerStates
from hybridtron.ops.ssd import ssd_chunked, ssd_ref

# documents of uneven lengths per row: one of a single token, one longer than the scan's chunk of 8, one that starts
# exactly on a chunk boundary (row 2: 8 + 8), a row that is one document
DOCUMENTS = [[7, 13, 1, 19], [25, 15], [8, 8, 24], [40]]


def packed_seq_idx(rows=DOCUMENTS) -> torch.Tensor:
    return torch.tensor([[index for index, length in enumerate(row) for _ in range(length)] for row in rows])


def test_document_spans_and_seq_idx_values_that_only_change():
    seq_idx = torch.tensor([[3, 3, 7, 7, 7, 9], [0, 0, 0, 0, 0, 0]])
    assert document_spans(seq_idx) == [(0, 0, 2), (0, 2, 5), (0, 5, 6), (1, 0, 6)]


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
def test_the_masked_chunked_scan_equals_the_reference_forward_and_backward(chunk, initial):
    g = torch.Generator().manual_seed(0)
    B, H, P, G, N = 4, 4, 3, 2, 5
    seq_idx = packed_seq_idx()
    T = seq_idx.shape[1]
    inputs = [torch.randn(B, T, H, P, generator=g, dtype=torch.float64), -torch.rand(B, T, H, generator=g,
                                                                                        dtype=torch.float64),
              torch.randn(B, T, G, N, generator=g, dtype=torch.float64),
              torch.randn(B, T, G, N, generator=g, dtype=torch.float64)]
    state = torch.randn(B, H, P, N, generator=g, dtype=torch.float64) if initial else None
    grads = []
    for scan in (ssd_chunked, ssd_ref):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y, final = scan(*leaves, chunk, state, seq_idx)
        (y.sin().sum() + final.cos().sum()).backward()
        grads.append((y.detach(), final.detach(), [leaf.grad for leaf in leaves]))
    (y, final, got), (want_y, want_final, want) = grads
    assert torch.allclose(y, want_y, atol=1e-12) and torch.allclose(final, want_final, atol=1e-12)
    assert all(torch.allclose(a, b, atol=1e-11) for a, b in zip(got, want))


def test_the_masked_mamba_mixer_and_attention_equal_their_references_forward_and_backward(small_config):
    config = small_config()
    seq_idx = packed_seq_idx()
    hidden = torch.randn(*seq_idx.shape, config.hidden_size)
    for mixer, reference in ((Mamba2Mixer(config), lambda m, h: mamba2_mixer_ref(m, h, seq_idx_BT=seq_idx)[0]),
                             (Attention(config), lambda m, h: attention_ref(m, h, seq_idx))):
        results = []
        for run in (lambda m, h: m(h, seq_idx=seq_idx), reference):
            mixer.zero_grad()
            leaf = hidden.clone().requires_grad_()
            out = run(mixer, leaf)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            results.append((out.detach(), leaf.grad, [p.grad.clone() for p in mixer.parameters()]))
        (out, grad, params), (want, want_grad, want_params) = results
        assert torch.allclose(out, want, atol=1e-5), type(mixer).__name__
        assert torch.allclose(grad, want_grad, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-5) for a, b in zip(params, want_params))


def _weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _packed_and_alone(model, ids, seq_idx, rows=DOCUMENTS):
    """(packed logits, packed MTP logits, packed grads) and the same assembled from each document run alone: the
    loss weighs every logit by fixed random weights, MTP depth d's only where t + d stays in t's document (the
    positions the labels score)."""
    depths = model.config.mtp_num_depths
    vocab = model.config.vocab_size
    weights = [_weights((*ids.shape, vocab), seed) for seed in range(depths + 1)]
    in_document = [torch.zeros(ids.shape, dtype=torch.bool)]
    for depth in range(1, depths + 1):
        ahead = F.pad(seq_idx[:, depth:], (0, depth), value=-1)
        in_document.append(ahead == seq_idx)
    model.zero_grad()
    out = model(ids, seq_idx=seq_idx)
    loss = (out.logits * weights[0]).sum()
    for depth, logits in enumerate(out.mtp_logits, start=1):
        loss = loss + (logits * weights[depth] * in_document[depth][..., None]).sum()
    loss.backward()
    packed = ([out.logits.detach(), *(m.detach() for m in out.mtp_logits)],
              {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    model.zero_grad()
    alone = [torch.zeros_like(t) for t in packed[0]]
    for row, lengths in enumerate(rows):
        start = 0
        for length in lengths:
            end = start + length
            out = model(ids[row:row + 1, start:end])
            loss = (out.logits[0] * weights[0][row, start:end]).sum()
            alone[0][row, start:end] = out.logits[0].detach()
            for depth, logits in enumerate(out.mtp_logits, start=1):
                mask = in_document[depth][row, start:end, None]
                loss = loss + (logits[0] * weights[depth][row, start:end] * mask).sum()
                alone[depth][row, start:end] = logits[0].detach() * mask
            loss.backward()
            start = end
    for depth in range(1, depths + 1):  # unscored MTP positions read the next document's token: not compared
        packed[0][depth] = packed[0][depth] * in_document[depth][..., None]
    return packed, (alone, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _assert_close_grads(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, grad in got.items():
        scale = want[name].abs().max().clamp(min=1.0)
        assert float((grad - want[name]).abs().max() / scale) < 1e-5, name


def test_a_packed_row_gives_every_document_its_logits_and_gradients_alone(small_config):
    """Every layer kind (Mamba-2, attention, LatentMoE, MLP) and the MTP block, fp32."""
    model = HybridLM(small_config())
    seq_idx = packed_seq_idx()
    ids = torch.randint(0, model.config.vocab_size, seq_idx.shape, generator=torch.Generator().manual_seed(3))
    (logits, grads), (want_logits, want_grads) = _packed_and_alone(model, ids, seq_idx)
    for got, want in zip(logits, want_logits):
        assert torch.allclose(got, want, atol=1e-5)
    _assert_close_grads(grads, want_grads)
    # and without the mask the documents do see each other (the test can tell them apart)
    assert not torch.allclose(model(ids).logits, want_logits[0], atol=1e-3)


def test_attention_calls_never_span_more_keys_than_a_document(small_config, monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(k.shape[2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)
    seq_idx = packed_seq_idx()
    Attention(small_config())(torch.randn(*seq_idx.shape, 48), seq_idx=seq_idx)
    assert sorted(seen) == sorted(length for row in DOCUMENTS for length in row)


def test_compiled_blocks_give_the_eager_numbers(small_config):
    model = HybridLM(small_config())
    seq_idx = packed_seq_idx()
    ids = torch.randint(0, model.config.vocab_size, seq_idx.shape, generator=torch.Generator().manual_seed(4))
    want = model(ids, seq_idx=seq_idx).logits
    for block in model.backbone.layers[:2]:  # a Mamba-2 block and an attention block, as `train.compile` does
        block.compile(backend="eager")  # dynamo traces it; code generation is not what is tested
    got = model(ids, seq_idx=seq_idx).logits
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("seq_idx, message", [
    (torch.tensor([[0, 0, 1, 0]]), "seq_idx: decreases in row 0 at position 3 (1 -> 0)"),
    (torch.tensor([[0, 0, 1]]), "seq_idx: shape (1, 3) != input_ids shape (1, 4)"),
    (torch.tensor([[0.0, 0, 1, 1]]), "seq_idx: expected an integer tensor"),
])
def test_a_bad_seq_idx_is_one_clear_line(small_config, seq_idx, message):
    model = HybridLM(small_config())
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model(torch.zeros(1, 4, dtype=torch.long), seq_idx=seq_idx)
    with pytest.raises(ValueError, match="seq_idx"):
        check_seq_idx(seq_idx, torch.zeros(1, 4, dtype=torch.long))


def test_seq_idx_with_a_decoding_cache_is_refused(small_config):
    model = HybridLM(small_config())
    cache = LayerStates.allocate(model.config, batch=1, max_len=8)
    with pytest.raises(ValueError, match="training forwards"):
        model(torch.zeros(1, 4, dtype=torch.long), seq_idx=torch.zeros(1, 4, dtype=torch.long), cache=cache)
