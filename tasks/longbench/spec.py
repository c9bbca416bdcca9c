"""LongBench v1 facts: prompt templates, max new tokens, metrics and dataset lists.

Source: THUDM/LongBench, commit 2e00731f8d0bff23dc4325161044d0ed8af94c1e,
LongBench/config/dataset2prompt.json, LongBench/config/dataset2maxlen.json, LongBench/eval.py and
LongBench/pred.py. The templates are data and must stay byte-exact, typos included ("asconcisely" in
narrativeqa, the leading space before " Answer the question" in qasper, "all news. " in multi_news);
tests/tasks/test_longbench_tasks.py checks them against a verbatim copy of the official JSON files.

This module has no dependencies so that any part of the project can import it by path.
"""

from __future__ import annotations

# Official dataset order (pred.py), LongBench v1.
LONGBENCH_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)

# LongBench-E: the 13 English/code datasets resampled for a uniform length distribution (pred.py --e).
LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)

# Prompt templates (config/dataset2prompt.json), filled with str.format(context=..., input=...)
# exactly as pred.py does with prompt_format.format(**record).
DATASET_PROMPT: dict[str, str] = {
    'narrativeqa': (
        'You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n'
        '\n'
        'Story: {context}\n'
        '\n'
        'Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n'
        '\n'
        'Question: {input}\n'
        '\n'
        'Answer:'
    ),
    'qasper': (
        'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        '\n'
        'Article: {context}\n'
        '\n'
        ' Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        '\n'
        'Question: {input}\n'
        '\n'
        'Answer:'
    ),
    'multifieldqa_en': (
        'Read the following text and answer briefly.\n'
        '\n'
        '{context}\n'
        '\n'
        'Now, answer the following question based on the above text, only give me the answer and do not output any other words.\n'
        '\n'
        'Question: {input}\n'
        'Answer:'
    ),
    'multifieldqa_zh': (
        '阅读以下文字并用中文简短回答：\n'
        '\n'
        '{context}\n'
        '\n'
        '现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n'
        '\n'
        '问题：{input}\n'
        '回答：'
    ),
    'hotpotqa': (
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'The following are given passages.\n'
        '{context}\n'
        '\n'
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'Question: {input}\n'
        'Answer:'
    ),
    '2wikimqa': (
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'The following are given passages.\n'
        '{context}\n'
        '\n'
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'Question: {input}\n'
        'Answer:'
    ),
    'musique': (
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'The following are given passages.\n'
        '{context}\n'
        '\n'
        'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n'
        '\n'
        'Question: {input}\n'
        'Answer:'
    ),
    'dureader': (
        '请基于给定的文章回答下述问题。\n'
        '\n'
        '文章：{context}\n'
        '\n'
        '请基于上述文章回答下面的问题。\n'
        '\n'
        '问题：{input}\n'
        '回答：'
    ),
    'gov_report': (
        'You are given a report by a government agency. Write a one-page summary of the report.\n'
        '\n'
        'Report:\n'
        '{context}\n'
        '\n'
        'Now, write a one-page summary of the report.\n'
        '\n'
        'Summary:'
    ),
    'qmsum': (
        'You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n'
        '\n'
        'Transcript:\n'
        '{context}\n'
        '\n'
        'Now, answer the query based on the above meeting transcript in one or more sentences.\n'
        '\n'
        'Query: {input}\n'
        'Answer:'
    ),
    'multi_news': (
        'You are given several news passages. Write a one-page summary of all news. \n'
        '\n'
        'News:\n'
        '{context}\n'
        '\n'
        'Now, write a one-page summary of all the news.\n'
        '\n'
        'Summary:'
    ),
    'vcsum': (
        '下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n'
        '会议记录：\n'
        '{context}\n'
        '\n'
        '会议总结：'
    ),
    'trec': (
        'Please determine the type of the question below. Here are some examples of questions.\n'
        '\n'
        '{context}\n'
        '{input}'
    ),
    'triviaqa': (
        'Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n'
        '\n'
        '{context}\n'
        '\n'
        '{input}'
    ),
    'samsum': (
        'Summarize the dialogue into a few short sentences. The following are some examples.\n'
        '\n'
        '{context}\n'
        '\n'
        '{input}'
    ),
    'lsht': (
        '请判断给定新闻的类别，下面是一些例子。\n'
        '\n'
        '{context}\n'
        '{input}'
    ),
    'passage_count': (
        'There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n'
        '\n'
        '{context}\n'
        '\n'
        'Please enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n'
        '\n'
        'The final answer is: '
    ),
    'passage_retrieval_en': (
        'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n'
        '\n'
        '{context}\n'
        '\n'
        'The following is an abstract.\n'
        '\n'
        '{input}\n'
        '\n'
        'Please enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n'
        '\n'
        'The answer is: '
    ),
    'passage_retrieval_zh': (
        '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n'
        '\n'
        '{context}\n'
        '\n'
        '下面是一个摘要\n'
        '\n'
        '{input}\n'
        '\n'
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n'
        '\n'
        '答案是：'
    ),
    'lcc': (
        'Please complete the code given below. \n'
        '{context}Next line of code:\n'
    ),
    'repobench-p': (
        'Please complete the code given below. \n'
        '{context}{input}Next line of code:\n'
    ),
}

# Max new tokens (config/dataset2maxlen.json).
DATASET_MAX_NEW_TOKENS: dict[str, int] = {
    'narrativeqa': 128,
    'qasper': 128,
    'multifieldqa_en': 64,
    'multifieldqa_zh': 64,
    'hotpotqa': 32,
    '2wikimqa': 32,
    'musique': 32,
    'dureader': 128,
    'gov_report': 512,
    'qmsum': 512,
    'multi_news': 512,
    'vcsum': 512,
    'trec': 64,
    'triviaqa': 32,
    'samsum': 128,
    'lsht': 64,
    'passage_count': 32,
    'passage_retrieval_en': 32,
    'passage_retrieval_zh': 32,
    'lcc': 64,
    'repobench-p': 64,
}

# Metric of each dataset (eval.py dataset2metric); names refer to functions in metrics.py.
DATASET_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

# eval.py keeps only the first non-empty line of the prediction for these few-shot datasets.
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# Metrics that tokenise Chinese with jieba (the only optional dependency of the family).
JIEBA_METRICS: frozenset[str] = frozenset({"qa_f1_zh_score", "rouge_zh_score"})

# LongBench-E length buckets (eval.py scorer_e), on the record's `length` field: words for
# English, characters for Chinese. Upper bounds are exclusive.
LENGTH_BUCKETS: tuple[tuple[str, int | None], ...] = (("0-4k", 4000), ("4-8k", 8000), ("8k+", None))


def length_bucket(length: int) -> str:
    """Name of the LongBench-E bucket holding a record of this `length`."""
    for name, upper in LENGTH_BUCKETS:
        if upper is None or length < upper:
            return name
    raise AssertionError("unreachable: the last bucket is unbounded")


def task_name(dataset: str, longbench_e: bool = False) -> str:
    """lm-eval task name of a dataset: ccq_longbench_<dataset> or ccq_longbench_e_<dataset>."""
    known = LONGBENCH_E_DATASETS if longbench_e else LONGBENCH_DATASETS
    if dataset not in known:
        family = "LongBench-E" if longbench_e else "LongBench"
        raise ValueError(f"{dataset!r} is not a {family} dataset; valid: {', '.join(known)}")
    return f"ccq_longbench_e_{dataset}" if longbench_e else f"ccq_longbench_{dataset}"
