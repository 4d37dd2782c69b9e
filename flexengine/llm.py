"""LLM: the offline API, a drop-in for vLLM's `LLM(...).generate(...)`."""
from __future__ import annotations

import contextlib
import gc
import itertools
import os

from tqdm.auto import tqdm

from .chat import chat_prompt_ids, conversations
from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, dtype="auto", device: str = "auto",
                 block_size: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 attention_backend: str | None = None, enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 seed: int = 0,
                 mask_mod=None, score_mod=None, num_scheduler_steps: int = 1, async_scheduling: bool | None = None):
        self.config = EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, seed=seed,
            mask_mod=mask_mod, score_mod=score_mod, num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling)
        self.llm_engine = LLMEngine(self.config)
        self.config = self.llm_engine.config  # with the defaults that depend on the device filled in
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params uses: SamplingParams() with the sampling fields the
        checkpoint's generation_config.json sets (vLLM's --generation-config auto)."""
        if not hasattr(self, "_default_params"):
            self._default_params = generation_config_defaults(self.llm_engine.runner.model_path)
        return SamplingParams(**self._default_params)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; the outputs come back in the order of `prompts`.

        A prompt is a str or {"prompt_token_ids": [...]}; `prompts` is one prompt or a list of them.
        `sampling_params` is one SamplingParams for all, or a list with one per prompt.
        """
        prompts = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if not isinstance(sampling_params, (list, tuple)):
            params = [sampling_params] * len(prompts)  # one for all (the engine checks its type)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.llm_engine
        for rid in list(engine.requests):  # left over from an interrupted call: not ours to finish
            engine.abort_request(rid)

        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, final_only=True)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # an invalid prompt rejects the whole call; undo the ones queued before it
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them,
        through the checkpoint's chat template (or `chat_template`), as vLLM's LLM.chat. One output per
        conversation, in order; each output's `prompt` is the templated text."""
        tokenizer = self.get_tokenizer()
        prompts = [chat_prompt_ids(tokenizer, conv, chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt) for conv in conversations(messages)]
        outputs = self.generate([{"prompt_token_ids": ids} for _, ids in prompts], sampling_params, use_tqdm)
        for out, (text, _) in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine, results = self.llm_engine, {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        generated = 0
        with heap_frozen():
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated} tokens out", refresh=False)
        bar.close()
        return [results[rid] for rid in ids]


# generation_config.json field → SamplingParams field: the sampling fields vLLM takes from it.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(model_path) -> dict:
    """The sampling fields of the checkpoint's generation_config.json that differ from transformers'
    defaults, as SamplingParams keywords ({} without the file), as vLLM reads them."""
    path = os.path.join(os.fspath(model_path), "generation_config.json") if model_path is not None else ""
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig
    config = GenerationConfig.from_pretrained(os.path.dirname(path)).to_diff_dict()
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                if config.get(theirs) is not None}
    return defaults


@contextlib.contextmanager
def heap_frozen():
    """Leave what existed before the run out of its garbage collections. A full collection walks every
    tracked object, and the steps wait for it: 124 ms for an engine of the embedded model on the CPU
    VM; a compiled GPU engine holds about 900,000 objects. Unfrozen afterwards, so garbage among them
    is still collected later. A heap someone already froze is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
