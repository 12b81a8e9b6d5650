"""An example corpus beyond the built-in English one: Chinese text, generated, no download.

:func:`write_chinese_corpus` writes ``documents`` text files of Chinese sentences drawn from a
small grammar (subject, time, place, verb, object, clause linkers and punctuation, a few hundred
common words), deterministic from ``seed``: each file is one document, about 290 KB in all
by default. The text is not meaningful prose, but it has what a tokenizer and a language
model meet in Chinese: three-byte UTF-8 characters, no spaces between words, full-width
punctuation, line breaks (some CRLF), and a few Latin words and digits mixed in; a trained
model's samples must decode with no U+FFFD.

    from ddp_exp.data.example_text import write_chinese_corpus
    write_chinese_corpus("zh_corpus")
    # ddp-exp prepare zh_corpus --out zh --tokenizer bpe --vocab-size 2000

May use: NumPy.
"""

from __future__ import annotations

import os

import numpy as np

SUBJECTS = ("我们", "他们", "老师", "学生", "研究人员", "工程师", "这个模型", "小明", "我的朋友",
            "数据科学家", "团队", "每个进程", "大家", "她", "他")
TIMES = ("今天", "昨天", "明天早上", "每天晚上", "上个星期", "在训练开始之前", "第一轮之后",
         "最近", "去年冬天", "周末")
PLACES = ("在北京", "在上海的实验室", "在图书馆", "在学校", "在服务器上", "在家里", "在公司",
          "在GPU集群上", "在会议室")
VERBS = ("学习", "讨论", "训练", "阅读", "编写", "测试", "比较", "整理", "发现", "计算", "保存",
         "分析", "改进", "验证")
OBJECTS = ("语言模型", "中文文本", "梯度", "数据集", "检查点", "论文", "代码", "实验结果",
           "学习率", "损失函数", "一本书", "新的方法", "分词器", "验证集", "随机种子")
ADVERBS = ("认真地", "很快地", "仔细地", "一起", "再次", "慢慢地", "顺利地")
LINKS = ("因为", "所以", "但是", "而且", "然后", "如果", "虽然")
ENDINGS = ("。", "。", "。", "！", "？", "；")
EXTRAS = ("（batch size 是 32）", "，大约 3.5 秒", "，用了 PyTorch", "（第 2 次）", "，准确率 97%")


def _sentence(rng: np.random.Generator) -> str:
    def pick(words):
        return words[int(rng.integers(len(words)))]

    parts = []
    if rng.random() < 0.5:
        parts.append(pick(TIMES))
    parts.append(pick(SUBJECTS))
    if rng.random() < 0.5:
        parts.append(pick(PLACES))
    if rng.random() < 0.4:
        parts.append(pick(ADVERBS))
    parts += [pick(VERBS), "了" if rng.random() < 0.5 else "", pick(OBJECTS)]
    text = "".join(parts)
    if rng.random() < 0.3:
        text += "，" + pick(LINKS) + pick(SUBJECTS) + pick(VERBS) + pick(OBJECTS)
    if rng.random() < 0.1:
        text += pick(EXTRAS)
    return text + pick(ENDINGS)


def chinese_document(rng: np.random.Generator, paragraphs: int = 4) -> str:
    """One document: a title line and ``paragraphs`` paragraphs of 3-8 sentences."""
    title = f"第{int(rng.integers(1, 1000))}篇：" + "".join(
        SUBJECTS[int(rng.integers(len(SUBJECTS)))] for _ in range(1)) + "的笔记"
    body = ["".join(_sentence(rng) for _ in range(int(rng.integers(3, 9))))
            for _ in range(paragraphs)]
    newline = "\r\n" if rng.random() < 0.2 else "\n"
    return newline.join([title, *body]) + newline


def write_chinese_corpus(folder: str, documents: int = 200, seed: int = 0) -> list[str]:
    """Write ``documents`` files ``doc_0000.txt ...`` of generated Chinese text (UTF-8) to
    ``folder`` (created); returns their paths. The same ``seed`` writes the same bytes. The
    default is about 290 KB."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(documents):
        path = os.path.join(folder, f"doc_{i:04d}.txt")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(chinese_document(rng, int(rng.integers(3, 7))))
        paths.append(path)
    return paths
