"""Tensor parallelism inside one worker, over torch.distributed's gloo (CPU) or NCCL (CUDA) backends.

``build.build_runner`` gives the engine a plain ``ModelRunner`` at degree 1 and a ``TPExecutor`` (rank 0,
driving ``tensor_parallel_size - 1`` rank processes) above it.

lm_head is held by rank 0 alone rather than split by vocabulary: a vocabulary-parallel lm_head would
save each rank ``1 / N`` of its weight reads but cost an all-gather of ``[batch, vocab]`` float32 logits
every step (12 MB at batch 64 and SmolLM2's 49,152 tokens), more than the weights it saves at the model
sizes tandem targets on one host; and sampling needs the whole row on one rank anyway.
"""

