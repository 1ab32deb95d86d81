"""A labelled grayscale image of 2D panels, written as a PNG, with no imaging library (a plain
install of gpu-console writes it: no matplotlib, no Pillow): ``autoencoder3d``'s slice of an
eval volume (input, reconstruction, clean target, difference).

Each panel is enlarged to at least :data:`MIN_SIDE` pixels, named above in a 5×7 bitmap font
(capitals, digits and a little punctuation, drawn twice as large), and has a grey bar under it
going from its darkest to its brightest value with the two values written at its ends, so a
reader sees what black and white stand for.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import torch

MIN_SIDE = 192  # pixels of a panel's side at least
TEXT_SCALE = 2  # the font's 5×7 pixels drawn 2×2
PAD = 12
BAR = 10  # the grey bar's height

_FONT = {  # 5 columns × 7 rows per glyph
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110",
    "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110",
    "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001",
    "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101",
    "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110",
    "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010",
    "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100",
    "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
    "|": "00100 00100 00100 00100 00100 00100 00100",
    "/": "00001 00010 00010 00100 01000 01000 10000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    " ": "00000 00000 00000 00000 00000 00000 00000",
}
GLYPH_W, GLYPH_H = 5, 7


def text(s: str, scale: int = TEXT_SCALE) -> torch.Tensor:
    """``s`` in capitals as a uint8 image: black (0) on white (255), a column between
    letters; a character the font lacks is left blank."""
    blank = _FONT[" "]
    cols = []
    for ch in s.upper():
        rows = _FONT.get(ch, blank).split()
        glyph = torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)
        cols += [glyph, torch.zeros(GLYPH_H, 1, dtype=torch.bool)]
    ink = torch.cat(cols[:-1], dim=1) if cols else torch.zeros(GLYPH_H, 0, dtype=torch.bool)
    ink = ink.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return torch.where(ink, 0, 255).to(torch.uint8)


def _number(v: float) -> str:
    return f"{v:.3g}"


def compose(
    title: str, panels: list[tuple[str, torch.Tensor, float, float]]
) -> tuple[torch.Tensor, dict[str, tuple[int, int, int, int]]]:
    """One image of ``panels`` (label, 2D values, the value drawn black, the value drawn
    white) side by side under ``title``: (the image, each panel's box (top, left, height,
    width) in it)."""
    h, w = panels[0][1].shape
    scale = max(1, -(-MIN_SIDE // min(h, w)))
    ph, pw = h * scale, w * scale
    labels = [text(label) for label, *_ in panels]
    ranges = [(text(_number(lo)), text(_number(hi))) for _, _, lo, hi in panels]
    col_w = max(pw, *(t.shape[1] for t in labels))
    heading = text(title)
    th = heading.shape[0]
    width = max(PAD + len(panels) * (col_w + PAD), heading.shape[1] + 2 * PAD)
    top = PAD + th + PAD  # a panel's label
    image_top = top + th + 4
    bar_top = image_top + ph + 4
    height = bar_top + BAR + 3 + th + PAD
    canvas = torch.full((height, width), 255, dtype=torch.uint8)
    _put(canvas, heading, PAD, PAD)
    boxes = {}
    for i, (label, values, lo, hi) in enumerate(panels):
        left = PAD + i * (col_w + PAD)
        _put(canvas, labels[i], top, left)
        span = hi - lo if hi > lo else 1.0
        shown = ((values.float() - lo) / span).clamp(0, 1)
        big = shown.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
        canvas[image_top - 1 : image_top + ph + 1, left - 1 : left + pw + 1] = 128  # a frame
        canvas[image_top : image_top + ph, left : left + pw] = (big * 255).round().to(torch.uint8)
        boxes[label] = (image_top, left, ph, pw)
        ramp = (torch.linspace(0, 255, pw).round().to(torch.uint8)).expand(BAR, pw)
        canvas[bar_top - 1 : bar_top + BAR + 1, left - 1 : left + pw + 1] = 128
        canvas[bar_top : bar_top + BAR, left : left + pw] = ramp
        low, high = ranges[i]
        _put(canvas, low, bar_top + BAR + 3, left)
        _put(canvas, high, bar_top + BAR + 3, left + pw - high.shape[1])
    return canvas, boxes


def _put(canvas: torch.Tensor, block: torch.Tensor, top: int, left: int) -> None:
    canvas[top : top + block.shape[0], left : left + block.shape[1]] = block


def write_png(path: Path, image: torch.Tensor) -> None:
    """An 8-bit grayscale PNG of ``image`` (height, width; uint8), written whole or not at
    all. The format's few chunks by hand rather than an imaging library (matplotlib, Pillow):
    a plain install then writes it too."""
    height, width = image.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), image], dim=1)  # filter 0
    data = zlib.compress(rows.contiguous().numpy().tobytes(), 6)

    def chunk(tag: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(tag + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit, grayscale
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data)
    png += chunk(b"IEND", b"")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(png)
    os.replace(tmp, path)
