"""torch.compile policy, warm-up and CUDA-graph capture for the model runner."""
from .policy import (RECOMPILE_LIMIT, allow_recompiles, bucket, compile_count, compiled_on_first_use, configure_dynamo,
                     decode_buckets, fused, fused_elementwise, mixed_decode_buckets, pdl_options, reset_fused,
                     set_fused_elementwise, start_compile_workers, tile_bucket, unoptimised_launcher_builds,
                     wide_q_tiles, without_duck_sizing)

__all__ = ["RECOMPILE_LIMIT", "allow_recompiles", "bucket", "compile_count", "compiled_on_first_use", "configure_dynamo",
           "decode_buckets", "fused", "fused_elementwise", "mixed_decode_buckets", "pdl_options", "reset_fused",
           "set_fused_elementwise", "start_compile_workers", "tile_bucket", "unoptimised_launcher_builds",
           "wide_q_tiles", "without_duck_sizing"]
