# Pixels travel from the processor to the vision encoder as the bytes they are: patches of the resized
# frames, [patches, C*T*P*P] uint8, a quarter of what the same patches take in float32 (a 10 s video's are
# 8 MB against 33 MB: copied into Triton's shared memory, to the thinker, digested by its prefix cache, and
# sent to the GPU). The image processor's rescale and normalize are a function of each byte and its channel,
# so they become a [C, 256] table, looked up on the encoder's device: the values are the processor's own,
# bit for bit.
from __future__ import annotations

import numpy as np
import torch


def pixel_table(image_processor) -> torch.Tensor:
    """[C, 256] float32: what `image_processor` (transformers' Qwen2-VL image processor, its rescale factor,
    mean and std) makes of each byte value in each channel."""
    channels = len(image_processor.image_mean)
    ramp = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)))
    scaled = image_processor.rescale(ramp, image_processor.rescale_factor)
    scaled = image_processor.normalize(scaled, image_processor.image_mean, image_processor.image_std)
    return torch.from_numpy(np.asarray(scaled, dtype=np.float32)[:, 0].copy())


def scale_pixels(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """pixels [patches, C*K] uint8 (each row C channels of K values) -> [patches, C*K] float32, on the
    device of `pixels`; table: pixel_table's, on that device."""
    n, width = pixels.shape
    channels = table.shape[0]
    # channel c's row of the table; int32 indices: half the bytes of int64 (index_select takes either)
    offsets = torch.arange(0, 256 * channels, 256, device=pixels.device, dtype=torch.int32)[:, None]
    index = pixels.view(n, channels, width // channels).int() + offsets
    return table.view(-1).index_select(0, index.view(-1)).view(n, width)
