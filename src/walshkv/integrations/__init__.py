"""walshkv inside other systems: LMCache (a serializer for its L2 storage) and Ray (sweeps and recommend
spread over a cluster). The vLLM plugin is a separate distribution (``plugins/vllm``), because vLLM's CPU
build pins a transformers release older than walshkv's.

Each module imports its third-party package lazily, where it is used, so that ``import walshkv`` never needs
them; docs/serving.md has the install lines, the configuration and what each integration compresses.
"""
