"""The worker: model weights, the paged KV cache, the persistent batch and the sampler.

``model_runner.ModelRunner`` is the seam used by both the in-process engine (``pagedserve.LLM``)
and the gRPC service (``grpc_server``): ``execute_model(SchedulerOutput) -> ModelRunnerOutput``.
Model families live in ``models/`` (one file each), weights come through transformers
(``loader``), randomness is counter-based (``sampler``).
"""
