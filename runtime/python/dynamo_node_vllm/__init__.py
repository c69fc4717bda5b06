"""dynamo-node as vLLM's KV tier: an OffloadingSpec for vLLM's OffloadingConnector.

vLLM loads it with ``spec_name="DynamoNodeSpec"`` and
``spec_module_path="dynamo_node_vllm"`` (see runtime/python/README.md).
"""

from .spec import DynamoNodeSpec

__all__ = ["DynamoNodeSpec"]
