"""`inflight download`: fetch the files a model server needs from the Hugging Face Hub or S3, resumably.

What the operator's download Job (and the init container without a cache) runs. See docs/model-cache.md.
"""
