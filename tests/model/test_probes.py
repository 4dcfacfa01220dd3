"""Probe inputs: deterministic, the right shapes, BOS explicit, clear errors."""

import pytest
import torch

from analysis import make_probe, natural_probe, probe_sets, random_probe, repeated_probe, text_probe
from analysis.model.probes import hf_dataset_texts, stdlib_texts


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def words(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 90, (n,), generator=g))


def test_offline_corpus_is_deterministic_prose():
    a, b = stdlib_texts(), stdlib_texts()
    assert a == b and len(a) > 100 and sum(map(len, a)) > 100_000


def test_natural_probe_on_the_real_tokenizer(smollm2):
    p = natural_probe(smollm2.tokenizer, n=100, T=64)
    q = natural_probe(smollm2.tokenizer, n=100, T=64)
    assert p.tokens.shape == (100, 64) and torch.equal(p.tokens, q.tokens)
    assert len({tuple(r) for r in p.tokens.tolist()}) == 100  # distinct windows
    assert not torch.equal(p.tokens, natural_probe(smollm2.tokenizer, n=100, T=64, seed=1).tokens)
    assert (p.tokens[:, 0] != smollm2.tokenizer.bos_token_id).all()
    text = smollm2.tokenizer.decode(p.tokens[0])
    assert sum(c.isalpha() for c in text) > len(text) / 2


def test_bos_is_explicit_and_keeps_T(tok):
    p = random_probe(tok, n=4, T=10, bos=True)
    assert p.tokens.shape == (4, 10) and (p.tokens[:, 0] == tok.bos_token_id).all()
    assert not (p.tokens[:, 1:] == tok.bos_token_id).any()
    r = repeated_probe(tok, n=4, T=10, bos=True)
    assert (r.tokens[:, 0] == 1).all() and (r.tokens[:, 1:] == r.tokens[:, 1:2]).all()


def test_random_excludes_special_tokens(tok):
    p = random_probe(tok, n=50, T=64, seed=5)
    assert not torch.isin(p.tokens, torch.tensor(tok.all_special_ids)).any()
    assert p.tokens.unique().numel() > 80  # spread over the vocabulary (93 ordinary ids)


def test_repeated_is_one_token_per_row(tok):
    p = repeated_probe(tok, n=8, T=16)
    assert (p.tokens == p.tokens[:, :1]).all()
    assert p.tokens[:, 0].unique().numel() > 1


def test_text_probe_windows_come_from_the_text(tok):
    text = words(500)
    stream = tok.encode(text, add_special_tokens=False)
    p = text_probe(tok, [text], n=10, T=20)
    s = " ".join(map(str, stream))
    for row in p.tokens.tolist():
        assert " ".join(map(str, row)) in s


def test_probe_sets_has_the_three_kinds(tok):
    sets = probe_sets(tok, n=3, T=8, kinds=("random", "repeated"))
    assert set(sets) == {"random", "repeated"} and all(s.tokens.shape == (3, 8) for s in sets.values())


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="no text to probe"):
        text_probe(tok, ["", "   "], n=2, T=4)
    with pytest.raises(ValueError, match="fewer than T=64"):
        text_probe(tok, ["w1 w2 w3"], n=2, T=64)
    with pytest.raises(ValueError, match="n must be at least 1"):
        random_probe(tok, n=0, T=4)
    with pytest.raises(ValueError, match="T must be at least 1"):
        repeated_probe(tok, n=2, T=0)
    with pytest.raises(ValueError, match="unknown probe kind 'poetry'"):
        make_probe("poetry", tok)


def test_hf_dataset_loader_with_a_local_file(tmp_path, tok):
    """The dataset path is real `datasets.load_dataset`; a local JSON file stands in for the hub."""
    pytest.importorskip("datasets")
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join('{"content": "%s"}' % words(40, seed=i) for i in range(5)))
    texts = hf_dataset_texts("json", data_files=str(f), text_field="content", n_texts=3)
    assert len(texts) == 3 and texts[0] == words(40, seed=0)
    with pytest.raises(ValueError, match="no field 'text'"):
        hf_dataset_texts("json", data_files=str(f))
    p = text_probe(tok, texts, n=4, T=16)
    assert p.tokens.shape == (4, 16)


def test_text_probe_tokenizes_a_corpus_once_per_tokenizer(tok):
    """The report cuts windows of one corpus at several lengths and seeds: the corpus is tokenized once."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def encode(self, text, **kw):
            self.calls += 1
            return self.inner.encode(text, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    texts = [words(200, seed=s) for s in range(3)]
    counting = Counting(tok)
    a = text_probe(counting, texts, n=4, T=16, seed=0)
    b = text_probe(counting, texts, n=6, T=32, seed=1)
    assert counting.calls == len(texts)
    assert torch.equal(a.tokens, text_probe(tok, texts, n=4, T=16, seed=0).tokens)  # as tokenized afresh
    assert torch.equal(b.tokens, text_probe(Counting(tok), texts, n=6, T=32, seed=1).tokens)
    text_probe(counting, texts[:2], n=4, T=16)  # another corpus: tokenized
    assert counting.calls == 2 * len(texts) - 1
