"""Images in: the checkpoint's own processor over decoded images, item hashes, placeholder spans, mRoPE positions
(the request side, engine/multimodal/processor.py), and the encoder cache's bookkeeping the scheduler keeps
(encoder_cache.py). The vision towers live with their families in engine/models/; the encoder step beside the model
runner in engine/worker/encoder_runner.py."""
