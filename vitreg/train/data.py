"""Training data: synthetic class-conditional batches made on the device, or an ImageFolder tree.

Both give the loop ``steps_per_epoch``, ``num_classes`` and ``batches(epoch, start)``, the ``(images, labels)``
on the device from batch ``start`` of ``epoch``: a resumed run sees exactly the batches it would have seen.
Synthetic data (the default) needs no disk and no loader processes, so a run measures the model, not the input
pipeline: a sample is its class's fixed random prototype, upsampled, plus noise, and batch ``k`` is a pure
function of ``(seed, rank, k)``. ``data=PATH`` is an ``ImageFolder`` layout read with timm's transforms; a file
that is no image or unreadable is refused before the run trains, one that cannot be decoded stops it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from vitreg.console import ticking
from vitreg.errors import VitregError, path_kind, unreadable

SYNTHETIC_IMAGES_PER_EPOCH = 10_000  # what one "epoch" of synthetic data means (steps = this // batch_size)
SYNTHETIC_DEFAULT_CLASSES = 1000  # an ImageNet-sized head, as the benchmarks use
_PROTOTYPE_SIZE = 4  # class prototypes are 4x4 images upsampled: cheap for 1000 classes, still separable
_NOISE_STD = 1.0


class UndecodableImage(VitregError):
    """An image of ``data=PATH`` that PIL cannot decode. Refused, not skipped: skipping would change the data set
    under the run (the epoch's length, the class balance, a resumed run's order) without anyone deciding it."""

    @classmethod
    def from_loader(cls, exc: "UndecodableImage") -> "UndecodableImage":
        """The worker's own message, from the whole traceback a DataLoader worker's error carries."""
        return cls(str(exc).rpartition(f"{cls.__name__}: ")[2])


def load_image(path: str):
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            image = Image.open(fh)
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        detail = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UndecodableImage(f"image {path} cannot be decoded ({detail}): replace or remove the file") from None


class SyntheticData:
    kind = "synthetic"

    def __init__(self, num_classes: int, img_size: int, batch_size: int, device, seed: int = 0, rank: int = 0,
                 world_size: int = 1, images_per_epoch: int = SYNTHETIC_IMAGES_PER_EPOCH):
        import torch

        self.num_classes = num_classes
        self.img_size = img_size
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seed = seed
        self.rank = rank
        self.steps_per_epoch = max(1, images_per_epoch // (batch_size * world_size))
        self.val = None  # no held-out set: val_top1 is reported for ImageFolder data only
        # the same prototypes on every rank, made on the CPU for determinism across devices
        g = torch.Generator().manual_seed(seed)
        self._prototypes = torch.randn(num_classes, 3, _PROTOTYPE_SIZE, _PROTOTYPE_SIZE, generator=g).to(self.device)
        self._gen = torch.Generator(device=self.device)

    def batch(self, index: int):
        import torch
        import torch.nn.functional as F

        # manual_seed is host-side, no device sync; modulo 2**63: a Generator's seed is a 64-bit integer
        self._gen.manual_seed(((self.seed * 1_000_003 + self.rank) * 1_000_000_007 + index) % (1 << 63))
        labels = torch.randint(0, self.num_classes, (self.batch_size,), generator=self._gen, device=self.device)
        means = F.interpolate(self._prototypes[labels], size=(self.img_size, self.img_size), mode="nearest")
        noise = torch.randn(means.shape, generator=self._gen, device=self.device) * _NOISE_STD
        return means + noise, labels

    def batches(self, epoch: int, start: int = 0):
        for i in range(start, self.steps_per_epoch):
            yield self.batch(epoch * self.steps_per_epoch + i)


def epoch_sampler(dataset, seed: int, rank: int, world_size: int):
    """torch's ``DistributedSampler`` that can start part-way through an epoch (``set_start(n)``: the first ``n``
    samples of this rank's shard skipped unloaded). Made here, not at import: planning a job imports no torch."""
    import itertools

    from torch.utils.data import DistributedSampler

    class EpochSampler(DistributedSampler):
        start = 0

        def set_start(self, start: int) -> None:
            self.start = start

        def __iter__(self):
            return itertools.islice(super().__iter__(), self.start, None)

        def __len__(self) -> int:
            return self.num_samples - self.start

    return EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)


class FolderData:
    kind = "folder"

    def __init__(self, spec, info, device, model=None, rank: int = 0, world_size: int = 1):
        import torch
        from timm.data import create_transform, resolve_data_config

        root, img_size, batch_size = spec.data, info.img_size, spec.batch_size
        num_workers, seed, num_classes = spec.num_workers, spec.seed, spec.num_classes or info.num_classes

        train_dir, val_dir = _check_layout(Path(root).expanduser())
        config = {**(resolve_data_config({}, model=model) if model is not None else {}),
                  "input_size": (3, img_size, img_size)}
        transform_train, transform_val = (create_transform(**config, is_training=t) for t in (True, False))
        self.train_set = _image_folder(root, train_dir, transform_train, "put .jpg/.png files in train/<class>/")
        self.classes = list(self.train_set.classes)
        self.num_classes = len(self.classes)
        if num_classes and num_classes != self.num_classes:
            raise VitregError(f"num_classes={num_classes} but data={root} has {self.num_classes} class folders in "
                              f"train/: pass num_classes=0 (take it from the data) or num_classes={self.num_classes}")
        if len(self.train_set) < batch_size * world_size:
            raise VitregError(f"data={root} has {len(self.train_set)} training images, fewer than one batch "
                              f"(batch_size={batch_size} x {world_size} process(es)): use a smaller batch_size")
        self.device = torch.device(device)
        self.batch_size = batch_size
        pin = self.device.type == "cuda"
        # workers from a forkserver, not forked from this process: its threads (MLflow's, torch's) may hold a heap
        # lock or be mid-update at a fork, and a forked worker can then die of "double free or corruption"
        loader_kw = dict(num_workers=num_workers, pin_memory=pin, persistent_workers=num_workers > 0,
                         **({"prefetch_factor": 4, "multiprocessing_context": "forkserver"} if num_workers > 0 else {}))
        self.sampler = epoch_sampler(self.train_set, seed, rank, world_size)
        # drop_last: every step has the same shape (no recompile, honest per-step timing)
        self.loader = torch.utils.data.DataLoader(self.train_set, batch_size=batch_size, sampler=self.sampler,
                                                  drop_last=True, **loader_kw)
        self.steps_per_epoch = len(self.train_set) // world_size // batch_size
        self.val = None
        if val_dir is not None:
            val_set = _image_folder(root, val_dir, transform_val, "fill val/<class>/ or remove val/")
            if list(val_set.classes) != self.classes:
                missing = sorted(set(self.classes) ^ set(val_set.classes))[:3]
                raise VitregError(f"data={root}: val/ and train/ have different class folders (e.g. {missing}): "
                                  f"make val/ hold the same class names as train/")
            self.val = torch.utils.data.DataLoader(val_set, batch_size=batch_size, shuffle=False, drop_last=False,
                                                   **{**loader_kw, "persistent_workers": False})

    def batches(self, epoch: int, start: int = 0):
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(start * self.batch_size)
        return self._on_device(self.loader)

    def val_batches(self):
        return self._on_device(self.val)

    def _on_device(self, loader):
        """``loader``'s batches on the device, a worker's UndecodableImage as the worker's one line."""
        try:
            for images, labels in loader:
                # non_blocking with pinned memory: the copy overlaps the previous step's GPU work
                yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        except UndecodableImage as exc:
            raise UndecodableImage.from_loader(exc) from None


def _image_folder(root, folder: Path, transform, fix: str):
    from torchvision import datasets

    try:
        return datasets.ImageFolder(str(folder), transform=transform, loader=load_image)
    except (FileNotFoundError, OSError) as exc:
        raise VitregError(f"data={root}: {folder} has class folders but no images torchvision can read "
                          f"({' '.join(str(exc).split())[:160]}): {fix}") from None


def _listing(root: Path, folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as exc:
        raise VitregError(f"data={root}: {unreadable(folder, exc)}, or move it out of the data folder") from None


def _is_dir(root: Path, path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError as exc:  # a parent this user may not enter
        raise VitregError(f"data={root}: {unreadable(path.parent, exc)}") from None


def _class_dirs(root: Path, path: Path) -> list[Path]:
    return sorted(Path(e.path) for e in _listing(root, path) if e.is_dir() and not e.name.startswith("."))


def _check_layout(root: Path, images: bool = False):
    """``root``'s train/ (and val/) folders, checked as ImageFolder will walk them; ``images``: every image
    file's header too, which the process that plans the job does once."""
    layout = "PATH/train/<class>/*.jpg (and optionally PATH/val/<class>/*.jpg)"
    fix = f"pass data=synthetic or a folder laid out as {layout}"
    kind = path_kind(root, "data", fix)
    if kind in ("missing", "file"):
        raise VitregError(f"data={root} {'does not exist' if kind == 'missing' else 'is a file, not a folder'}: {fix}")
    train_dir = root / "train"
    if not _is_dir(root, train_dir):
        raise VitregError(f"data={root} has no train/ sub-folder: lay it out as {layout}")
    classes = _class_dirs(root, train_dir)
    if not classes:
        raise VitregError(f"data={root}: train/ has no class folders: put each class's images in train/<class>/ "
                          f"({layout})")
    if len(classes) == 1:  # cross-entropy over one class is 0 from the first step: nothing would be learned
        raise VitregError(f"data={root}: train/ has one class folder ({classes[0].name}): a classifier needs at "
                          f"least two; add train/<another class>/ or use data=synthetic")
    val_dir = root / "val" if _is_dir(root, root / "val") else None
    if val_dir is not None and not _class_dirs(root, val_dir):
        raise VitregError(f"data={root}: val/ has no class folders: put images in val/<class>/ or remove val/")
    with ticking(f"checking the image headers under data={root}") if images else contextlib.nullcontext():
        for split in filter(None, (train_dir, val_dir)):
            for folder, entries in _folders(root, split):
                if images and folder != split:  # ImageFolder loads the class folders' files, not train/'s own
                    _check_images(root, entries)
    return train_dir, val_dir


def _folders(root: Path, top: Path):
    """``(folder, entries)`` under ``top`` as ImageFolder walks it (following links), each real folder once. A link
    back to a folder read already is refused: ImageFolder would read its images again and again (a class counted
    41 times over)."""
    seen: set[str] = set()
    stack = [top]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            raise VitregError(f"data={root}: {folder} leads back to {real}, a folder read already (a symbolic "
                              f"link loop would count its images again and again): remove the link")
        seen.add(real)
        entries = _listing(root, folder)
        stack += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=True)]
        yield folder, entries


def _check_images(root: Path, entries: list[os.DirEntry]) -> None:
    """Every file ImageFolder will load is readable and starts like an image a PIL plugin reads: 16 bytes each,
    not a decode, so a text file named ``.jpg`` is refused before the run trains (a broken body is refused when
    :func:`load_image` decodes it)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for entry in entries:
        if entry.name.lower().endswith(IMG_EXTENSIONS) and not entry.is_dir():
            _check_header(root, entry.path)


def _check_header(root: Path, path: str) -> None:
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(16)
    except OSError as exc:
        raise VitregError(f"data={root}: {unreadable(path, exc)}, or remove it") from None
    from PIL import Image

    Image.init()  # every plugin, each with its header test in Image.OPEN
    if not any(_accepts(test, prefix) for _, test in Image.OPEN.values()) and not _pil_opens(path):
        raise UndecodableImage(f"data={root}: {path} is not an image (no image format starts like it): replace or "
                               f"remove the file")


def _accepts(header_test, prefix: bytes) -> bool:
    try:
        return header_test is not None and bool(header_test(prefix))
    except Exception:  # noqa: BLE001 - a plugin's test indexing past a short prefix (an empty file)
        return False


def _pil_opens(path: str) -> bool:
    """PIL's lazy open (nothing decoded): for a format PIL knows by its parser alone."""
    from PIL import Image

    try:
        with Image.open(path):
            return True
    except Image.DecompressionBombError:
        return True  # an image, too large to decode: load_image says so in its own line
    except (OSError, ValueError, SyntaxError):
        return False


def build_data(spec, info, device, model=None, rank: int = 0, world_size: int = 1):
    if spec.synthetic:
        num_classes = spec.num_classes or SYNTHETIC_DEFAULT_CLASSES
        return SyntheticData(num_classes, info.img_size, spec.batch_size, device, spec.seed, rank, world_size)
    check_num_workers(spec.num_workers)
    return FolderData(spec, info, device, model=model, rank=rank, world_size=world_size)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or Slurm's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_num_workers(num_workers: int) -> None:
    """Refuse more DataLoader processes than the machine can run: each holds a copy of the dataset's index
    (hundreds of MB); past two per usable CPU they only wait their turn, at thousands the OOM killer ends the run."""
    most = max(2, 2 * usable_cpus())
    if num_workers > most:
        raise VitregError(f"num_workers={num_workers} is more DataLoader processes than this machine's "
                          f"{usable_cpus()} usable CPUs can run: use num_workers<={most} (2 per CPU at most)")


def resolve_num_classes(spec, check_images: bool = False) -> int:
    """The head size before the model exists: ``num_classes``, else the class folders of ``data``, checked."""
    if spec.num_classes:
        return spec.num_classes
    if spec.synthetic:
        return SYNTHETIC_DEFAULT_CLASSES
    from torchvision.datasets.folder import find_classes

    train_dir, _ = _check_layout(Path(spec.data).expanduser(), images=check_images)
    return len(find_classes(str(train_dir))[0])  # exactly what ImageFolder will count
