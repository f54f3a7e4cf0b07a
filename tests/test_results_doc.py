"""docs/benchmarks.md's generated tables are what their JSON results render to: a figure changed on either side
is caught, and a table naming results that do not exist is refused."""

import json

import pytest

from policy_bundle.loadtest import results_doc


def build_figures(seconds=600.0):
    stage = {"rss": 2.0e9, "pss": 1.5e9, "main_rss": 1.2e9}
    return {"policy": "SmolLM2-135M-Instruct", "dtype": "float32", "weights_bytes": 5.4e8, "procs": "default",
            "seconds": seconds, "rss": 4.1e9, "pss": 3.2e9, "main_rss": 2.8e9, "vllm_rss": 2.4e9,
            "verdict": "pass", "rc": 0, "processes": 4, "fp32_layers": 2,
            "gate": {"recipe": "smooth-w8a8", "held_out": {"top1": 0.9804, "kl_mean": 0.0016, "greedy": 0.55}},
            "stages": [{"stage": "load policy", **stage, "seconds": 5.3}, {"stage": "calibrate", **stage, "seconds": None}]}


def context_figures():
    fig = {"128": 50.0, "2048": 35.0, "7000": 22.0, "kv_bytes_per_token": 23040}
    return {"positions": [128, 2048, 7000], "tokens": 32, "repeats": 2,
            "engines": {"int8": fig, "llama.cpp": {**fig, "128": 40.0}, "float16": {**fig, "7000": 11.0}}}


@pytest.fixture
def docs(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's workers set it; a command records it
    results = tmp_path / "results"
    results_doc.write_result(results / "build.json", "bench_build", build_figures(), argv=["--shape", "smollm2",
                                                                                          "--json", "x.json"])
    results_doc.write_result(results / "context.json", "bench_context", context_figures(), argv=[])
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nprose\n\n<!-- results: build -->\n<!-- /results -->\n\nmore prose\n\n"
                   "<!-- results: context -->\nstale\n<!-- /results -->\n")
    return doc, results


def run(doc, results, *flags):
    return results_doc.main(["--doc", str(doc), "--results", str(results), *flags])


def test_the_shipped_benchmarks_doc_matches_its_results():
    assert results_doc.main(["--check"]) == 0


def test_tables_are_rendered_from_the_results_and_prose_is_kept(docs):
    doc, results = docs
    assert run(doc, results, "--check") == 1  # empty and stale blocks
    assert run(doc, results) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n\n<!-- results: build -->\n") and "\nmore prose\n" in text
    assert "stale" not in text
    assert "| 10.0 min |" in text and "7.6x the weights, 4 processes" in text
    assert "held out top-1 0.9804, KL mean 0.0016, greedy 0.55 (exit 0)" in text
    assert text.index("| load policy | 5.3 s |") < text.index("| calibrate | - |")  # the build's order
    assert "`.venv/bin/python -m policy_bundle.loadtest.bench_build --shape smollm2`" in text  # --json left out
    assert "INT8 against llama.cpp Q8_0 (1 thread, float16 cache): 1.25x at 128, 1.00x at 2048, 1.00x at 7000." in text
    assert "| vLLM FP16 | 50.0 | 35.0 | 11.0 | 0.22x | 23040 |" in text
    assert run(doc, results, "--check") == 0


def test_a_figure_changed_on_either_side_is_caught(docs, capsys):
    doc, results = docs
    run(doc, results)
    good = doc.read_text()
    doc.write_text(good.replace("| 10.0 min |", "| 9.0 min |"))  # edited by hand in the doc
    assert run(doc, results, "--check") == 1
    assert "in: build" in capsys.readouterr().err
    doc.write_text(good)
    res = json.loads((results / "context.json").read_text())
    res["figures"]["engines"]["int8"]["128"] = 51.0  # a new run's figure, not yet rendered
    (results / "context.json").write_text(json.dumps(res))
    assert run(doc, results, "--check") == 1
    assert "in: context" in capsys.readouterr().err


def test_a_table_whose_results_do_not_exist_is_refused(docs):
    doc, results = docs
    doc.write_text(doc.read_text() + "<!-- results: missing -->\n<!-- /results -->\n")
    with pytest.raises(SystemExit, match="'missing'.*does not exist"):
        run(doc, results, "--check")


def test_a_benchmark_that_keeps_tables_is_rendered_as_it_printed_them(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tab = results_doc.table(["decode", "us per token", "same text"], [["whole", 1017, True], ["stream", 8.25, False],
                                                                    ["a|b", 13.0, True]])
    results_doc.write_tables(tmp_path / "results" / "detok.json", "bench_detok", "2000 tokens", [tab],
                             ["Incremental against whole: 0.008x."], argv=["--tokens", "2000", "--json=x.json"])
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- results: detok -->\n<!-- /results -->\n")
    assert run(doc, tmp_path / "results") == 0
    text = doc.read_text()
    # the threads it ran on recorded, where the figures went left out
    assert "`OMP_NUM_THREADS=1 .venv/bin/python -m policy_bundle.loadtest.bench_detok --tokens 2000` on " in text
    assert ", 2000 tokens:\n\n" + results_doc.markdown(tab) in text
    assert "| whole | 1017 | yes |\n| stream | 8.25 | no |\n| a\\|b | 13.0 | yes |\n" in text  # as rounded
    assert "Incremental against whole: 0.008x.\n<!-- /results -->" in text
    res = json.loads((tmp_path / "results" / "detok.json").read_text())
    res["figures"].pop("tables")  # neither a renderer of its own nor tables: refused, not rendered empty
    (tmp_path / "results" / "detok.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="bench_detok.*no renderer and no tables"):
        run(doc, tmp_path / "results", "--check")
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        results_doc.table(["a", "b"], [[1]])  # a row short of the columns
