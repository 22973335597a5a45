"""Training-side patches: make a Hugging Face model's forward the canonical forward."""
from .logprobs import stock_token_logprobs, token_logprobs
from .patch import (SUPPORTED_ARCHITECTURES, ScoreTokens, TokenScoresOutput, checkpoint_activations, is_patched,
                    patch_model)

__all__ = ["SUPPORTED_ARCHITECTURES", "ScoreTokens", "TokenScoresOutput", "checkpoint_activations", "is_patched",
           "patch_model", "stock_token_logprobs", "token_logprobs"]
