"""Mixture weights (presets, TOML), proportional proxy sub-sampling, the repetition guard and the report."""

from __future__ import annotations

import json
import math

import pytest

from hybridtron.data import build_data
from hybridtron.data.mixture import (QUALITY_MULTIPLIERS, BucketPlan, MixtureReport, mixture_weights,
                                     preset_weights, proxy_keep)

TOKENS = {"json/q1": 1000, "json/q5": 3000, "re/q3": 6000, "web": 10000}


def test_presets():
    natural = preset_weights("natural", TOKENS)
    assert natural == pytest.approx({name: tokens / 20000 for name, tokens in TOKENS.items()})
    assert preset_weights("uniform", TOKENS) == pytest.approx({name: 0.25 for name in TOKENS})
    quality = preset_weights("quality", TOKENS)
    raw = {"json/q1": 1000 * QUALITY_MULTIPLIERS[1], "json/q5": 3000 * QUALITY_MULTIPLIERS[5],
           "re/q3": 6000 * QUALITY_MULTIPLIERS[3], "web": 10000.0}  # no level: multiplier 1
    assert quality == pytest.approx({name: value / sum(raw.values()) for name, value in raw.items()})
    assert quality["json/q5"] / quality["json/q1"] == pytest.approx(3 * 4)
    with pytest.raises(ValueError, match="unknown preset 'natrual'"):
        mixture_weights("natrual", TOKENS)


def test_toml_rules(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('base = "uniform"\n[weights]\n"json/*" = 0.5\n"json/q5" = 0.0\n[multipliers]\n"*" = 3\n"web" = 2\n')
    weights = mixture_weights(str(path), TOKENS)
    # uniform 0.25 each; json/* -> 0.5, the later exact rule sets json/q5 to 0; then x3 all, x2 web
    raw = {"json/q1": 1.5, "json/q5": 0.0, "re/q3": 0.75, "web": 1.5}
    assert weights == pytest.approx({name: value / sum(raw.values()) for name, value in raw.items()})


@pytest.mark.parametrize("content, message", [
    ("[weights\n", r"not valid TOML"),
    ('[weights]\n"json/q6" = 1\n', r"unknown bucket 'json/q6'; did you mean 'json/q5'"),
    ('[weights]\n"xml/*" = 1\n', r"pattern 'xml/\*' matches no bucket"),
    ('[multipliers]\n"web" = -1\n', r"\[multipliers\] 'web' = -1; expected a finite number >= 0"),
    ('[weights]\n"web" = "high"\n', r"'web' = 'high'; expected a finite number"),
    ('bucket_weights = 1\n', r"unknown keys \['bucket_weights'\]"),
    ('base = "best"\n', r"base = 'best'; expected one of natural, uniform, quality"),
    ('[multipliers]\n"*" = 0\n', r"every bucket weight is zero"),
    ('weights = 3\n', r"\[weights\] must be a table"),
])
def test_toml_errors(tmp_path, content, message):
    path = tmp_path / "mix.toml"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        mixture_weights(str(path), TOKENS)


def test_missing_toml_file(tmp_path):
    with pytest.raises(ValueError, match=r"mix\.toml does not exist"):
        mixture_weights(str(tmp_path / "mix.toml"), TOKENS)


def test_proxy_keep_hits_the_target_exactly():
    lengths = [50, 30, 70, 20, 40]  # 210 tokens
    assert proxy_keep(lengths, 1.0) == (5, 0)
    assert proxy_keep(lengths, 0.5) == (2, 25)  # 50 + 30 whole, then 25 of the 70-token document: 105
    assert proxy_keep(lengths, 80 / 210) == (2, 0)  # exactly two whole documents
    assert proxy_keep(lengths, 81 / 210) == (2, 0)  # a 1-token cut (bos only) is dropped
    assert proxy_keep([1000], 1e-6) == (0, 2)  # at least a bos and one token


def _report(**overrides):
    buckets = (BucketPlan("a/q1", 3, 100, 100, 0.5, 150.0), BucketPlan("b/q2", 5, 300, 300, 0.3, 90.0),
               BucketPlan("c/q3", 2, 50, 50, 0.2, 60.0))
    values = dict(mixture="natural", total_tokens=300, proxy_of=None, max_epochs=1.0, buckets=buckets,
                  val_documents=2, val_tokens=40)
    return MixtureReport(**{**values, **overrides})


def test_guard_names_the_worst_bucket_and_by_how_much():
    report = _report()
    with pytest.raises(ValueError, match=r"bucket 'a/q1' would be repeated 1\.50 times \(150 planned tokens of 100 "
                                         r"available, 1\.50x max_epochs=1\); 1 more buckets exceed it too: c/q3 "
                                         r"\(1\.20\).*allow_repeat=True"):
        report.check_epochs(allow_repeat=False)
    report.check_epochs(allow_repeat=True)
    _report(max_epochs=1.5).check_epochs(allow_repeat=False)


def test_report_format_and_json(tmp_path):
    report = _report(proxy_of=3000)
    text = report.format(max_rows=2)
    assert "proxy of 3,000 (ratio 0.1)" in text
    assert text.splitlines()[2].startswith("a/q1")  # largest share first
    assert "... 1 more buckets: 20.00% of the tokens, max epochs 1.200" in text
    saved = json.loads(report.save(tmp_path / "mixture.json").read_text())
    assert saved["proxy_ratio"] == pytest.approx(0.1)
    assert [b["epochs"] for b in saved["buckets"]] == pytest.approx([1.5, 0.3, 1.2])
    assert len(str(report).splitlines()) == 2 + 3 + 1


# ------------------------------------------------------------------------------------- through build_data
def test_proxy_keeps_every_bucket_share_and_repetition_rate(small_data_config):
    full_budget = 400_000
    full = build_data(small_data_config(total_tokens=full_budget, mixture="quality", allow_repeat=True))
    proxy = build_data(small_data_config(total_tokens=full_budget // 20, proxy_of=full_budget, mixture="quality",
                                         allow_repeat=True))
    full_plan = {b.name: b for b in full.mixture_report.buckets}
    proxy_plan = {b.name: b for b in proxy.mixture_report.buckets}
    assert proxy_plan.keys() == full_plan.keys() and len(proxy_plan) > 10  # no bucket dropped
    for name, p in proxy_plan.items():
        f = full_plan[name]
        assert p.weight == pytest.approx(f.weight)  # the same shares
        assert p.full_tokens == f.tokens
        assert p.tokens == max(math.ceil(f.tokens / 20), 2)  # sliced by exactly the ratio
        # the proxy repeats each bucket as often as the full run does (up to the one-token rounding)
        assert p.epochs == pytest.approx(f.epochs, rel=20 / p.tokens + 1e-9)
    # the slice is a fixed prefix: another seed sees the same documents
    other_seed = build_data(small_data_config(total_tokens=full_budget // 20, proxy_of=full_budget,
                                              mixture="quality", allow_repeat=True, seed=7))
    for a, b in zip(proxy.train_loader.buckets, other_seed.train_loader.buckets):
        assert (a.starts == b.starts).all() and (a.lengths == b.lengths).all()


def test_guard_through_build_data(small_data_config):
    config = small_data_config(mixture="uniform")
    with pytest.raises(ValueError, match=r"mixture uniform: bucket '[a-z]+/q[1-5]' would be repeated \d+\.\d\d times"):
        build_data(config)
    bundle = build_data(small_data_config(mixture="uniform", allow_repeat=True))
    worst = max(bundle.mixture_report.buckets, key=lambda b: b.epochs)
    assert worst.epochs > 1
    # the natural mixture over one pass never repeats
    assert max(b.epochs for b in build_data(small_data_config()).mixture_report.buckets) == pytest.approx(1.0)


def test_toml_with_unknown_bucket_through_build_data(small_data_config, tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[weights]\n"jsno/q3" = 1.0\n')
    with pytest.raises(ValueError, match=r"unknown bucket 'jsno/q3'; did you mean 'json/q3'"):
        build_data(small_data_config(mixture=str(path)))
