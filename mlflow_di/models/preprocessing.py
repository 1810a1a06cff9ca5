"""How raw uint8 NHWC images become a model's input, and how its output becomes probabilities.

The spec travels with the model: mlflow-di stores it in the MLflow model's metadata (key
``mlflow_di`` -> ``preprocessing``) and in ONNX metadata, and the CLI can override any field
(``--preprocessing scale=1,mean=125.3/123/113.9``).

Images of any size (a raw-image step): ``resize=S`` scales each raw image so that its shorter
side is S (aspect ratio kept, bilinear with antialiasing), then ``center_crop=H/W`` (or one
number for a square) cuts the centre out, so ``resize=256,center_crop=224`` is torchvision's
ImageNet eval transform (``Resize(256)`` + ``CenterCrop(224)`` on a PIL image, pixel for pixel).
The step works on uint8 pixels and gives uint8 pixels of the model's input size, before
scale/mean/std. It belongs to the model, not to the data: the same folder of photos of every
size feeds a 224x224 and a 299x299 model, and a compressed export inherits the step with the rest
of the preprocessing. Where it runs: :meth:`Preprocessing.prepare` puts it on a data set, lazily
(each image is resized as its batch is decoded, so a folder of mixed sizes is never held whole),
and the commands do that when data meets a model; :meth:`Preprocessing.apply` runs it on images
whose size is not yet the step's output size, so raw arrays of another size work too, while
images already of that size (prepared ones, fuzzing mutants) pass untouched.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from mlflow_di.errors import UserError

LAYOUTS = ("NCHW", "NHWC")
#: Most channels one interleaved OpenCV lookup takes (its Mat holds at most 128 in OpenCV 5, 512 in
#: 4); more go plane by plane.
_INTERLEAVED_CHANNELS = 128
OUTPUTS = ("logits", "probabilities")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """x = (raw * scale - mean) / std, then transposed to ``layout``; float32.

    ``mean``/``std`` are per channel (or one value for all). ``output`` says what the model
    returns: ``logits`` (softmax is applied to get probabilities) or ``probabilities``.
    ``input_shape`` is (H, W, C) of one raw image, when known, to check data against.
    ``resize``/``center_crop``: the raw-image step (see the module docstring); None: images must
    already have the model's size.
    """

    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str = "NCHW"
    output: str = "logits"
    input_shape: tuple[int, int, int] | None = None
    resize: int | None = None
    center_crop: tuple[int, int] | None = None

    def __post_init__(self):
        object.__setattr__(self, "mean", tuple(float(v) for v in np.atleast_1d(self.mean)))
        object.__setattr__(self, "std", tuple(float(v) for v in np.atleast_1d(self.std)))
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", tuple(int(v) for v in self.input_shape))
        if self.layout not in LAYOUTS:
            raise UserError(f"preprocessing layout must be one of {LAYOUTS}, got '{self.layout}'")
        if self.output not in OUTPUTS:
            raise UserError(f"preprocessing output must be one of {OUTPUTS}, got '{self.output}'")
        if any(s == 0 for s in self.std):
            raise UserError("preprocessing std must not contain 0")
        if self.resize is not None:
            object.__setattr__(self, "resize", _positive_ints("resize", self.resize, 1)[0])
        if self.center_crop is not None:
            crop = _positive_ints("center_crop", self.center_crop, 2)
            object.__setattr__(self, "center_crop", crop * 2 if len(crop) == 1 else crop)
        self._check_image_size()

    def _check_image_size(self) -> None:
        """One image as the model takes it (float32) must fit :func:`~mlflow_di.input_files.check_allocation`,
        checked on the declared sizes before any image of that size is made (a crafted model's input 50,000
        pixels wide would otherwise take the machine's memory on its first probe)."""
        from mlflow_di.input_files import check_allocation

        channels = self.input_shape[2] if self.input_shape is not None else 3
        for field, (height, width) in (("input_shape", (self.input_shape or (0, 0))[:2]),
                                       ("center_crop", self.center_crop or (0, 0)),
                                       ("resize", (self.resize or 0, self.resize or 0))):
            check_allocation(f"one image of the preprocessing's {field} ({height}x{width}x{channels}, float32)",
                             4 * height * width * channels, "check the model's input size, or set --preprocessing "
                             f"{field}= to the size the model classifies at")

    # ------------------------------------------------------------------ raw-image step
    @property
    def has_raw_step(self) -> bool:
        """Whether raw images of any size are resized/cropped to the model's size first."""
        return self.resize is not None or self.center_crop is not None

    def needs_raw_step(self, height: int, width: int) -> bool:
        """Whether an image of this size is not yet what the raw-image step makes."""
        if self.center_crop is not None:
            return (height, width) != self.center_crop
        return self.resize is not None and min(height, width) != self.resize

    def raw_image(self, image: np.ndarray) -> np.ndarray:
        """The raw-image step on one uint8 (H, W, C) image: resize (shorter side), then centre crop."""
        if self.resize is not None:
            image = resize_shorter_side(image, self.resize)
        if self.center_crop is not None:
            image = center_crop(image, *self.center_crop)
        return image

    def prepare(self, data):
        """An ImageSet whose images come out of the raw-image step as they are read (the set itself if there is none)."""
        if not self.has_raw_step:
            return data
        shape = None
        if self.center_crop is not None:
            channels = self.input_shape[2] if self.input_shape is not None else data.image_shape[2]
            shape = (*self.center_crop, channels)
        return data.map_images(self.raw_image, shape)

    def check_images(self, images: np.ndarray) -> None:
        """Raise a one-line :class:`UserError` when images do not fit this model's input.

        Images the raw-image step will resize are checked for their channels only.
        """
        if images.ndim != 4:
            raise UserError(f"expected images of shape (N, H, W, C), got shape {images.shape}")
        if len(images) == 0:
            raise UserError("no images given (empty data)")
        resized = self.has_raw_step and self.needs_raw_step(*images.shape[1:3])
        if resized and self.input_shape is not None and images.shape[3] != self.input_shape[2]:
            raise UserError(f"images have {images.shape[3]} channel(s) but the model expects {self.input_shape[2]}; "
                            "use data with that many channels")
        if not resized and self.input_shape is not None and tuple(images.shape[1:]) != self.input_shape:
            h, w, c = self.input_shape
            if tuple(images.shape[1:3]) == (h, w):  # only the channels differ: no resize mends that
                raise UserError(f"images have {images.shape[3]} channel(s) but the model expects {c} "
                                f"({h}x{w}x{c}); use data with {c} channel(s)")
            raise UserError(
                f"images are {images.shape[1]}x{images.shape[2]}x{images.shape[3]} (HxWxC) but the model "
                f"expects {h}x{w}x{c}; use data of that size (e.g. mnist for 28x28x1, digits for 8x8x1), or give "
                f"the model a raw-image step (--preprocessing resize={max(h, w)},center_crop={h}/{w})"
            )
        channels = images.shape[3]
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise UserError(f"preprocessing {name} has {len(values)} values but images have {channels} channels")

    def shape_mismatch(self, model_name: str, error: Exception) -> UserError:
        """The one-line error for a model that cannot run on this preprocessing's input shape."""
        shape = "x".join(map(str, self.input_shape)) if self.input_shape else "the given"
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UserError(f"{model_name} cannot run on {shape} (HxWxC) inputs ({detail}); give the model's own input "
                         "shape with --preprocessing input_shape=H/W/C, or leave the stored preprocessing as it is")

    def apply(self, images: np.ndarray) -> np.ndarray:
        """Raw uint8 (N, H, W, C) -> float32 model input in ``layout`` (after the raw-image step, if needed).

        uint8 pixels take 256 values per channel, so their inputs are looked up in a table of
        :meth:`arithmetic`'s own float32 results (:func:`_levels`), the same bits: at 224x224 the
        arithmetic on every value cost a CPU about as much as a small CNN's forward pass, and the
        lookup is several times cheaper (benchmarks/RESULTS.md, "Preprocessing").
        """
        self.check_images(images)
        if self.has_raw_step and self.needs_raw_step(*images.shape[1:3]):
            images = np.stack([self.raw_image(image) for image in images])
            self.check_images(images)
        if images.dtype != np.uint8:
            return self.arithmetic(images)
        import cv2

        n, h, w, c = images.shape
        table = _levels(self.scale, self.mean, self.std, c)
        if c == 1 or (self.layout == "NHWC" and c <= _INTERLEAVED_CHANNELS):  # one pass, channels interleaved
            rows = np.ascontiguousarray(images).reshape(n * h, w, c)
            if c == 1:
                looked_up = cv2.LUT(rows[..., 0], table[0])
            else:  # an interleaved table: entry v holds level v of every channel
                looked_up = cv2.LUT(rows, np.ascontiguousarray(table.T)[None])
            x = looked_up.reshape(n, h, w, c)
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if self.layout == "NCHW" else x
        planes = np.ascontiguousarray(images.transpose(0, 3, 1, 2))  # uint8: a quarter of the floats' bytes
        x = np.empty((n, c, h, w), np.float32)
        for i in range(n):  # contiguous planes in and out; faster than a NumPy gather at any size
            for channel in range(c):
                cv2.LUT(planes[i, channel], table[channel], dst=x[i, channel])
        return x if self.layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))

    def arithmetic(self, images: np.ndarray) -> np.ndarray:
        """:meth:`apply`'s values computed on every pixel value (images of any dtype, already of the model's size)."""
        x = images.astype(np.float32) * np.float32(self.scale)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x)

    def apply_on(self, images, device):
        """:meth:`apply` computed by torch on ``device``: the uint8 batch travels (4x fewer bytes than
        floats) and the arithmetic runs where the model is. The same float32 operations in the same
        order, so the values equal :meth:`apply`'s; images that need the raw-image step take that path.
        ``images`` may also be a uint8 tensor (a campaign's mutants made on the device: nothing travels)."""
        import torch

        self.check_images(images)
        if isinstance(images, torch.Tensor):
            if self.has_raw_step and self.needs_raw_step(*images.shape[1:3]):
                images = images.cpu().numpy()  # the raw-image step is OpenCV's, on the host
            else:
                return self._normalised(images.to(device), device)
        if self.has_raw_step and self.needs_raw_step(*images.shape[1:3]):
            return torch.from_numpy(self.apply(images)).to(device)
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # torch warns on read-only arrays (e.g. IDX files read from bytes)
            images = images.copy()
        return self._normalised(torch.from_numpy(images).to(device), device)

    def _normalised(self, images, device):
        """A uint8 NHWC tensor on ``device`` -> the float32 model input there (:meth:`arithmetic` in torch)."""
        import torch

        x = images.float() * self.scale
        x = (x - torch.tensor(self.mean, dtype=torch.float32, device=device)) / torch.tensor(
            self.std, dtype=torch.float32, device=device)
        return x.permute(0, 3, 1, 2).contiguous() if self.layout == "NCHW" else x

    def tensor_on(self, images: np.ndarray, device=None):
        """Model input as a float32 torch tensor on ``device`` (None: the CPU), preprocessed where it is
        cheapest: :meth:`apply`'s table lookup on the CPU, :meth:`apply_on` on a GPU (the uint8 batch
        travels, a quarter of the floats' bytes). The same values either way."""
        import torch

        if device is None or torch.device(device).type == "cpu":
            return torch.from_numpy(self.apply(images))
        return self.apply_on(images, device)

    def to_probabilities(self, outputs: np.ndarray) -> np.ndarray:
        """Model outputs -> probabilities (softmax over logits; probabilities passed through)."""
        outputs = np.asarray(outputs, dtype=np.float32)
        if self.output == "probabilities":
            return outputs
        shifted = outputs - outputs.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=1, keepdims=True)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        for key in ("resize", "center_crop"):  # models without the step keep the metadata older readers know
            if values[key] is None:
                del values[key]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "Preprocessing":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise UserError(f"unknown preprocessing fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Preprocessing":
        return cls.from_dict(json.loads(text))

    def override(self, text: str | None) -> "Preprocessing":
        """Apply a command-line override ``key=value,...`` (tuples as ``a/b/c``), e.g. ``scale=1,layout=NHWC``."""
        if not text:
            return self
        changes = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not value.strip():
                raise UserError(f"bad preprocessing override '{item}'; write key=value, e.g. scale=1,layout=NHWC")
            if key in ("mean", "std", "input_shape", "resize", "center_crop"):
                try:
                    changes[key] = tuple(float(v) for v in value.split("/"))
                except ValueError:
                    raise UserError(f"preprocessing {key} must be numbers separated by '/', got '{value}'") from None
                if key in ("input_shape", "resize", "center_crop"):
                    changes[key] = _positive_ints(key, changes[key], {"input_shape": 3, "resize": 1}.get(key, 2))
                if key == "resize":
                    changes[key] = changes[key][0]
            elif key == "scale":
                try:
                    changes[key] = float(value)
                except ValueError:
                    raise UserError(f"preprocessing scale must be a number, got '{value}'") from None
            elif key in ("layout", "output"):
                changes[key] = value.strip()
            else:
                raise UserError(
                    f"unknown preprocessing field '{key}'; known: scale, mean, std, layout, output, input_shape, "
                    "resize, center_crop"
                )
        return dataclasses.replace(self, **changes)


class ModelInputs:
    """Raw uint8 images (an array or lazy images) seen as float32 model input, preprocessed one slice at a time.

    ``inputs[a:b]`` is ``preprocessing.apply(images[a:b])``, so a big set is never held as floats
    (a 224x224x3 float32 input is 600 KB, four times its raw pixels).
    """

    dtype = np.dtype(np.float32)
    ndim = 4

    def __init__(self, images, preprocessing: Preprocessing):
        preprocessing.check_images(images)
        self.images, self.preprocessing = images, preprocessing
        self._shape = None

    def __len__(self) -> int:
        return len(self.images)

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, ...) of the model input: the first image is preprocessed once to learn it."""
        if self._shape is None:
            self._shape = (len(self), *self[0:1].shape[1:])
        return self._shape

    def __getitem__(self, index) -> np.ndarray:
        return self.preprocessing.apply(self.images[index])


def _levels(scale: float, mean: tuple[float, ...], std: tuple[float, ...], channels: int) -> np.ndarray:
    """(channels, 256) float32: the model input of each uint8 level in each channel, by the same
    float32 operations in the same order as :meth:`Preprocessing.arithmetic`. Cached by the settings'
    bit patterns (0.0 and -0.0 are equal keys to a dict but give different bits)."""
    return _levels_of(np.array([scale, *mean, *std], np.float64).tobytes(), len(mean), channels)


@functools.lru_cache(maxsize=64)
def _levels_of(settings: bytes, means: int, channels: int) -> np.ndarray:
    values = np.frombuffer(settings, np.float64)
    levels = np.arange(256, dtype=np.uint8).astype(np.float32) * np.float32(values[0])
    mean = np.broadcast_to(values[1:1 + means].astype(np.float32), (channels,))[:, None]
    std = np.broadcast_to(values[1 + means:].astype(np.float32), (channels,))[:, None]
    table = (levels[None, :] - mean) / std
    table.flags.writeable = False
    return table


#: The largest side (pixels) a resize or crop may ask for: 16384x16384 RGB is already 768 MiB an image.
MAX_SIDE = 16384


def _positive_ints(name: str, values, most: int) -> tuple[int, ...]:
    """``values`` (a number or up to ``most`` numbers) as positive ints of at most :data:`MAX_SIDE`; a one-line
    UserError otherwise."""
    values = tuple(np.atleast_1d(np.asarray(values, dtype=object)).tolist())

    def bad(value) -> bool:
        try:
            return isinstance(value, bool) or float(value) != int(value) or not 1 <= int(value) <= MAX_SIDE
        except (TypeError, ValueError, OverflowError):
            return True

    if not 1 <= len(values) <= most or any(bad(v) for v in values):
        example = {"resize": "resize=256", "center_crop": "center_crop=224 or center_crop=224/192"}.get(name, "")
        shown = "/".join(str(v) if len(str(v)) <= 20 else f"{str(v)[:8]}...({len(str(v))} digits)" for v in values)
        raise UserError(f"preprocessing {name} must be {'one' if most == 1 else f'1 to {most}'} whole number(s) from 1 "
                        f"to {MAX_SIDE}, got {shown}" + (f"; e.g. {example}" if example else ""))
    return tuple(int(v) for v in values)


def resize_shorter_side(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, C) resized so that its shorter side is ``size``, as torchvision's ``Resize(size)`` on a PIL image.

    Bilinear with PIL's antialiasing; the longer side becomes ``int(size * long / short)``.
    """
    from PIL import Image

    height, width = image.shape[:2]
    short, long = sorted((height, width))
    new_long = int(size * long / short)
    new_height, new_width = (size, new_long) if height <= width else (new_long, size)
    if (new_height, new_width) == (height, width):
        return image
    if image.shape[2] in (1, 3):
        pil = Image.fromarray(image[..., 0] if image.shape[2] == 1 else image)
        resized = np.asarray(pil.resize((new_width, new_height), Image.BILINEAR))
        return resized.reshape(new_height, new_width, image.shape[2])
    return np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(image[..., c])).resize(
        (new_width, new_height), Image.BILINEAR)) for c in range(image.shape[2])], axis=-1)


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre ``height`` x ``width`` of uint8 (H, W, C), as torchvision's ``CenterCrop`` (zero padding if smaller)."""
    h, w = image.shape[:2]
    if h < height or w < width:  # torchvision pads with zeros on both sides first
        top, left = max(height - h, 0) // 2, max(width - w, 0) // 2
        padded = np.zeros((max(h, height), max(w, width), image.shape[2]), np.uint8)
        padded[top:top + h, left:left + w] = image
        image, h, w = padded, *padded.shape[:2]
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return image[top:top + height, left:left + width]
