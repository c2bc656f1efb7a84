"""Draws the app's icons (a rounded square with a dot whose colour is the server's state) as
PNG files with the standard library only, so they can be redrawn anywhere: python3 make_icons.py"""
import struct
import zlib
from pathlib import Path

STATES = {
    "icon": (46, 125, 50),  # the app icon: ready's green
    "tray-stopped": (120, 120, 120),
    "tray-loading": (230, 160, 20),
    "tray-ready": (46, 160, 67),
    "tray-error": (200, 40, 40),
}


def png(size, pixel):
    raw = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y, size)) for x in range(size)) for y in range(size)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def painter(colour):
    def pixel(x, y, n):
        # Capybara-brown rounded square, the state's colour as a dot in the middle.
        r = n * 0.18
        cx = min(max(x + 0.5, r), n - r)
        cy = min(max(y + 0.5, r), n - r)
        if (x + 0.5 - cx) ** 2 + (y + 0.5 - cy) ** 2 > r * r:
            return (0, 0, 0, 0)
        d = ((x + 0.5 - n / 2) ** 2 + (y + 0.5 - n / 2) ** 2) ** 0.5
        if d < n * 0.30:
            return (*colour, 255)
        return (139, 100, 70, 255)

    return pixel


if __name__ == "__main__":
    here = Path(__file__).parent
    for name, colour in STATES.items():
        for size in ([32, 128, 256] if name == "icon" else [32]):
            suffix = "" if (name != "icon" or size == 256) else f"-{size}"
            (here / f"{name}{suffix}.png").write_bytes(png(size, painter(colour)))
