"""``walshkv needle``: needle-in-a-haystack / passkey retrieval with a compressed cache, offline.

What a run measures: can the model still find a fact buried in a long context when that context's K/V went
through the cache under test? KL divergence (``walshkv eval``) says how far a codec moves the next-token
distribution; this says whether a long-range lookup survives it, the failure users see first.

The protocol (RULER's NIAH tasks on local text, https://github.com/NVIDIA/RULER):

1. A haystack: whole sentences of a local text (``python-docs`` or a UTF-8 file such as
   ``../shared/data/austen_emma.txt``), from a seeded start sentence, as many as fit the length.
2. Needles: ``"The special magic number for {key} is: {7 digits}."`` sentences with seeded keys
   (``adjective-noun``) and values, inserted between sentences. The queried needle sits at depth ``d``
   (0: before the first haystack sentence, 1: after the last); other needles at seeded random depths.
   Tasks (:data:`TASKS`): ``single`` (one needle), ``multikey`` (``keys`` needles with different keys, one
   asked for: the others are distractors), ``multivalue`` (``values`` needles with the same key, all asked for).
3. The prompt: an instruction, the haystack, the question, and the start of the answer
   (``"The special magic number for {key} mentioned in the provided text is"``), inside the model's chat
   template (the user turn, then the assistant turn begun with the answer) when its tokenizer has one
   (``prompt="auto"``), else as plain text. A trial of length ``L`` has a prompt of at most
   ``L - new_tokens`` tokens, so prompt and answer fit ``L`` positions.
4. Each cache reads the same prompt: the uncompressed reference first (transformers' ``DynamicCache`` at the
   model's dtype), then each codec (:func:`walshkv.cache.make_cache`: walshkv specs and presets, llama.cpp
   types, KIVI, TurboQuant, Hugging Face's ``hf-*``). The prompt is prefilled ``prefill_chunk`` tokens per
   forward (no ``[ctx, ctx]`` attention tensor), quantize-on-write by default (every token attention reads was
   compressed first, as in ``walshkv eval``; ``prefill="exact"`` is the serving-engine convention); then
   greedy decoding, one token per forward, for up to ``new_tokens`` tokens (stopping at EOS or once the
   numbers asked for are written).
5. Exact match: the first number of the answer must be the value (``single``, ``multikey``); for
   ``multivalue`` every value must be among the numbers written (``score`` is the share found).

Reported: a codec's accuracy only in the cells (task, length, depth) where the reference itself reaches
``min_baseline`` (default 80%), since a loss can only be measured where the model succeeds uncompressed; the
other cells are flagged (hatched in the heatmaps, named under the tables), never hidden from the files.
``retained`` is the share of the trials the reference got right that the codec got right too.

Intervals (:mod:`~walshkv.eval.needle.cells`; the trial is the unit). Every accuracy in the cells, summaries and
overall rows, and ``retained``, has a 95% Wilson score interval beside it (``accuracy_ci95``,
``measured_accuracy_ci95``, ... as ``[low, high]``); for ``multivalue`` a trial is right when every value is found,
and the mean share found (``score``) has no interval. Each codec is also compared with the reference on the same
trials, as pairs: ``lost`` and ``gained`` (the discordant pairs), ``difference`` (its accuracy minus the
reference's) with Newcombe's paired score interval ``difference_ci95``, and the exact McNemar p-value
``mcnemar_p``. Tables print ``80% [49, 94]``; the CSV splits each interval into ``*_ci95_low`` and
``*_ci95_high``; the heatmaps name each cell's trials (``n=5``). With ``--samples 5`` (the default, and the least
for a published grid) a cell where all 5 trials succeed still reads ``100% [57, 100]``: cells tell where retrieval
breaks, the pooled rows how much a codec loses. Runs added together (``--add-to``) get their intervals from all
their trials, never from the parts' intervals.

The depths of one (task, length, sample) share their haystack up to the first needle: each cache runs them
deepest needle first and keeps the tokens the previous prompt had in common (``cache.crop``), so a grid costs
about 30% less prefill (``share_prefix``; the codes are the same, every token being compressed on its own).

Every trial is a pure function of ``(seed, task, sample, length, depth)``, the text and the tokenizer
(:func:`make_trials`): the same command builds the same prompts.

Modules, each importing only those above it: :mod:`~walshkv.eval.needle.trials` (haystacks, needles,
prompts: :func:`make_trials`), :mod:`~walshkv.eval.needle.scoring` (exact match),
:mod:`~walshkv.eval.needle.cells` (:class:`NeedleResult` and its cells, summaries and overall rows),
:mod:`~walshkv.eval.needle.run` (:class:`NeedleConfig`, :func:`run_needle`), :mod:`~walshkv.eval.needle.merge`
(runs added together: ``--add-to``), :mod:`~walshkv.eval.needle.report` (tables, markdown, heatmaps, files).
Their public names are re-exported here.
"""

from walshkv.eval.needle.cells import (
    BASELINE,
    MIN_BASELINE,
    NeedleResult,
    cell_rows,
    measurable_cells,
    overall_rows,
    summary_rows,
)
from walshkv.eval.needle.merge import MERGE_KEYS, check_can_add, load_needle_result, merge_needle_results
from walshkv.eval.needle.report import (
    CSV_KEYS,
    describe_needle,
    flag_note,
    format_needle_table,
    needle_markdown,
    plot_heatmaps,
    write_needle_outputs,
)
from walshkv.eval.needle.run import DEFAULT_NEEDLE_CODECS, NeedleConfig, run_needle
from walshkv.eval.needle.scoring import score_answer
from walshkv.eval.needle.trials import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_SAMPLES,
    PROMPTS,
    TASKS,
    Needle,
    PromptStyle,
    Task,
    Trial,
    default_new_tokens,
    haystack_sentences,
    make_trials,
    parse_depths,
    parse_lengths,
    prompt_style,
)

__all__ = [
    "BASELINE",
    "CSV_KEYS",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_NEEDLE_CODECS",
    "DEFAULT_SAMPLES",
    "MERGE_KEYS",
    "MIN_BASELINE",
    "PROMPTS",
    "TASKS",
    "Needle",
    "NeedleConfig",
    "NeedleResult",
    "PromptStyle",
    "Task",
    "Trial",
    "cell_rows",
    "check_can_add",
    "default_new_tokens",
    "describe_needle",
    "flag_note",
    "format_needle_table",
    "haystack_sentences",
    "load_needle_result",
    "make_trials",
    "measurable_cells",
    "merge_needle_results",
    "needle_markdown",
    "overall_rows",
    "parse_depths",
    "parse_lengths",
    "plot_heatmaps",
    "prompt_style",
    "run_needle",
    "score_answer",
    "summary_rows",
    "write_needle_outputs",
]
