"""LongBench scoring end to end through lm_eval.simple_evaluate, with a scripted LM that returns fixed
strings for the fixture prompts: exercises process_results, per-dataset means, LongBench-E length
buckets and the group averages."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tasks" / "longbench"
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"
REFERENCE_PROMPTS = json.loads((FIXTURES / "reference" / "dataset2prompt.json").read_text(encoding="utf-8"))
REFERENCE_MAXLEN = json.loads((FIXTURES / "reference" / "dataset2maxlen.json").read_text(encoding="utf-8"))

V1 = list(REFERENCE_PROMPTS)
E = ["qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
     "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
CATEGORY_MEMBERS = {
    "single_doc_qa": ["narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"],
    "multi_doc_qa": ["hotpotqa", "2wikimqa", "musique", "dureader"],
    "summarization": ["gov_report", "qmsum", "multi_news", "vcsum"],
    "few_shot": ["trec", "triviaqa", "samsum", "lsht"],
    "synthetic": ["passage_count", "passage_retrieval_en", "passage_retrieval_zh"],
    "code": ["lcc", "repobench-p"],
}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}
WRONG = "~"  # shares no word, digit, class name or character with any fixture answer: scores 0
# ROUGE-L of a text with itself: P = R = 1 -> 2 / (2 + 1e-8) (the `rouge` package's smoothing)
ROUGE_SELF = 2.0 / (2.0 + 1e-8)
ROUGE_DATASETS = {"gov_report", "qmsum", "multi_news", "vcsum", "samsum", "dureader"}


def _records(file_name):
    lines = (FIXTURES / file_name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _gold_reply(dataset, gold):
    # the four few-shot datasets get extra lines that only eval.py's first-line cut removes
    return f"\n{gold}\nQuestion: more words that would lower the score" if dataset in FIRST_LINE else gold


def _script():
    """prompt -> (reply, expected sample score x100). v1: record 0 answered with its first gold answer;
    E: records 0 and 2 (buckets 0-4k and 4-8k) answered; every other record gets WRONG, except the
    narrativeqa record 1 which gets a partial answer."""
    replies, expected = {}, {}
    for longbench_e, datasets in ((False, V1), (True, E)):
        for dataset in datasets:
            records = _records(f"{dataset}_e.jsonl" if longbench_e else f"{dataset}.jsonl")
            answered = {0, 2} if longbench_e else {0}
            full = 100.0 * (ROUGE_SELF if dataset in ROUGE_DATASETS else 1.0)
            scores = []
            for index, record in enumerate(records):
                prompt = REFERENCE_PROMPTS[dataset].format(**record)
                assert prompt not in replies, f"fixture prompts must be unique ({dataset} #{index})"
                if index in answered:
                    replies[prompt], score = _gold_reply(dataset, record["answers"][0]), full
                elif dataset == "narrativeqa" and not longbench_e and index == 1:
                    # "the lamp was lit" vs "the lamp": tokens lamp was lit / lamp -> P = 1/3, R = 1 -> 0.5
                    replies[prompt], score = "the lamp was lit", 50.0
                else:
                    replies[prompt], score = WRONG, 0.0
                scores.append((record["length"], score))
            expected[(longbench_e, dataset)] = scores
    return replies, expected


@pytest.fixture(scope="module")
def evaluation():
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    replies, expected = _script()

    class ScriptedLM(LM):
        def __init__(self):
            super().__init__()
            self.requests = []

        def generate_until(self, requests, disable_tqdm=False):
            self.requests.extend(request.args for request in requests)
            return [replies[request.args[0]] for request in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError("LongBench tasks only generate")

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError("LongBench tasks only generate")

    lm = ScriptedLM()
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False,
                          metadata={"data_dir": str(FIXTURES)})
    output = simple_evaluate(model=lm, tasks=["ccq_longbench", "ccq_longbench_e"], task_manager=manager,
                             log_samples=False, bootstrap_iters=0)
    return output["results"], expected, lm.requests


def _mean(values):
    return sum(values) / len(values)


def test_every_request_used_the_official_generation_settings(evaluation):
    _, expected, requests = evaluation
    assert len(requests) == sum(len(scores) for scores in expected.values())
    prompt_to_dataset = {}
    for dataset, template in REFERENCE_PROMPTS.items():
        for file_name in (f"{dataset}.jsonl", f"{dataset}_e.jsonl"):
            if (FIXTURES / file_name).exists():
                for record in _records(file_name):
                    prompt_to_dataset[template.format(**record)] = dataset
    for prompt, gen_kwargs in requests:
        dataset = prompt_to_dataset[prompt]
        assert gen_kwargs == {"until": [], "max_gen_toks": REFERENCE_MAXLEN[dataset], "do_sample": False}


def test_dataset_scores(evaluation):
    results, expected, _ = evaluation
    for dataset in V1:
        want = _mean([score for _, score in expected[(False, dataset)]])
        assert results[f"ccq_longbench_{dataset}"]["score,none"] == pytest.approx(want, abs=1e-9), dataset
    # spot checks written out: narrativeqa (100 + 50) / 2; qasper 3 records, one answered
    assert results["ccq_longbench_narrativeqa"]["score,none"] == pytest.approx(75.0)
    assert results["ccq_longbench_qasper"]["score,none"] == pytest.approx(100 / 3)
    # triviaqa: the reply "\nMediterranean Sea\nQuestion: ..." scores 100 only after the first-line cut
    assert results["ccq_longbench_triviaqa"]["score,none"] == pytest.approx(50.0)


def test_longbench_e_buckets(evaluation):
    results, expected, _ = evaluation
    for dataset in E:
        values = results[f"ccq_longbench_e_{dataset}"]
        scores = expected[(True, dataset)]
        # fixture lengths 1200, 3100, 5600, 9400 -> buckets 0-4k (2 records), 4-8k, 8k+
        assert [length for length, _ in scores] == [1200, 3100, 5600, 9400]
        full = scores[0][1]
        assert values["score,none"] == pytest.approx(full / 2)
        assert values["score_0-4k,none"] == pytest.approx(full / 2)  # answered + wrong
        assert values["score_4-8k,none"] == pytest.approx(full)  # answered
        assert values["score_8k+,none"] == pytest.approx(0.0)  # wrong


def test_group_scores_are_unweighted_means_over_datasets(evaluation):
    results, _, _ = evaluation
    per_dataset = {d: results[f"ccq_longbench_{d}"]["score,none"] for d in V1}
    assert results["ccq_longbench"]["score,none"] == pytest.approx(_mean(list(per_dataset.values())))
    for category, members in CATEGORY_MEMBERS.items():
        assert results[f"ccq_longbench_{category}"]["score,none"] == pytest.approx(
            _mean([per_dataset[d] for d in members])), category
    for metric in ("score", "score_0-4k", "score_4-8k", "score_8k+"):
        values = [results[f"ccq_longbench_e_{d}"][f"{metric},none"] for d in E]
        assert results["ccq_longbench_e"][f"{metric},none"] == pytest.approx(_mean(values)), metric
