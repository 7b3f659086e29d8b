"""lm-evaluation-harness scores a log-likelihood task through ``yirage serve``'s
``/v1/completions`` (its ``local-completions`` model: ``echo`` with ``logprobs``, token ids as
the prompt, two requests at a time) and gets the per-example log-likelihoods its own ``hf`` model
gets from transformers on the same weights, within 1e-3."""
import pathlib

import pytest
import yaml

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

from yirage.serve import ServeOptions, create_app  # noqa: E402

from test_serve import LLM_NAME, running  # noqa: E402  (tests/serve is on sys.path)

DATA = pathlib.Path(__file__).parent / "data"


def _task_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """The task YAML of tests/serve/data, its JSONL given by absolute path, in a folder of its own."""
    config = yaml.safe_load((DATA / "yirage_tiny.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(DATA / config["dataset_kwargs"]["data_files"]["test"])
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "yirage_tiny.yaml").write_text(yaml.safe_dump(config))
    return folder


def _loglikelihoods(results) -> list[list[float]]:
    """Per example, the log-likelihood of each choice (the harness' logged responses)."""
    samples = sorted(results["samples"]["yirage_tiny"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_loglikelihoods_equal_the_hf_model(smollm, hf_smollm, gguf_once, tmp_path):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from yirage.models.registry import resolve_model

    path = resolve_model(LLM_NAME).path
    with gguf_once():   # transformers' own tokenizer of the same file, saved for the harness
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    tasks = TaskManager(include_path=str(_task_dir(tmp_path)))
    app = create_app(ServeOptions(LLM_NAME, parallel=4, timeout_s=120), llm=smollm)
    with running(app) as base:
        ours = lm_eval.simple_evaluate(
            model="local-completions", tasks=["yirage_tiny"], task_manager=tasks, log_samples=True,
            model_args={"base_url": f"{base}/v1/completions", "model": LLM_NAME, "tokenizer": str(tokenizer_dir),
                        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 2,
                        "max_retries": 1})
    reference = lm_eval.simple_evaluate(model=HFLM(pretrained=hf_smollm, tokenizer=tokenizer, batch_size=1),
                                        tasks=["yirage_tiny"], task_manager=tasks, log_samples=True)
    got, want = _loglikelihoods(ours), _loglikelihoods(reference)
    assert len(got) == 8 and [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-3)
    assert ours["results"]["yirage_tiny"]["acc,none"] == reference["results"]["yirage_tiny"]["acc,none"]
