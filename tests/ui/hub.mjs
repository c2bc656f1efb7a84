// A local hub that answers like Hugging Face (model info with ?blobs=true, resolve with Range),
// with faults on demand: cut a transfer after N bytes, advertise a wrong SHA-256.
import http from "node:http";
import crypto from "node:crypto";

export const sha256 = (b) => crypto.createHash("sha256").update(b).digest("hex");
export const gitBlobSha1 = (b) =>
  crypto.createHash("sha1").update(Buffer.concat([Buffer.from(`blob ${b.length}\0`), b])).digest("hex");

export function content(len, seed) {
  const b = Buffer.alloc(len);
  for (let i = 0; i < len; i++) b[i] = ((Math.imul(i, 2654435761) >>> 24) ^ seed) & 0xff;
  return b;
}

/** repos: { "owner/name": [{ path, data: Buffer, lfs: bool, wrongChecksum?: bool }] } */
export function startHub(repos) {
  const state = { ranges: [], cutNext: {}, chunkDelayMs: 2 };
  const server = http.createServer(async (req, res) => {
    const url = new URL(req.url, "http://x");
    let m = url.pathname.match(/^\/api\/models\/([^/]+\/[^/]+)$/);
    if (m) {
      const files = repos[m[1]];
      if (!files) { res.writeHead(404, { "content-type": "application/json" }); return res.end('{"error":"Repository not found"}'); }
      const siblings = files.map((f) => {
        const data = f.wrongChecksum ? Buffer.from("something else") : f.data;
        return f.lfs
          ? { rfilename: f.path, size: f.data.length, blobId: gitBlobSha1(Buffer.from("pointer")), lfs: { sha256: sha256(data), size: f.data.length, pointerSize: 134 } }
          : { rfilename: f.path, size: f.data.length, blobId: gitBlobSha1(data) };
      });
      res.writeHead(200, { "content-type": "application/json" });
      return res.end(JSON.stringify({ id: m[1], siblings }));
    }
    m = url.pathname.match(/^\/([^/]+\/[^/]+)\/resolve\/[^/]+\/(.+)$/);
    const file = m && (repos[m[1]] || []).find((f) => f.path === decodeURIComponent(m[2]));
    if (!file) { res.writeHead(404); return res.end("Entry not found"); }
    const range = req.headers["range"] || null;
    state.ranges.push({ repo: m[1], path: file.path, range });
    let start = 0;
    const headers = { "content-type": "application/octet-stream", "accept-ranges": "bytes" };
    if (range) {
      start = Number(/^bytes=(\d+)-$/.exec(range)[1]);
      headers["content-range"] = `bytes ${start}-${file.data.length - 1}/${file.data.length}`;
    }
    const body = file.data.subarray(start);
    headers["content-length"] = body.length;
    res.writeHead(range ? 206 : 200, headers);
    const key = `${m[1]}/${file.path}`;
    const cut = state.cutNext[key]; delete state.cutNext[key];
    // A cut sends exactly `cut` bytes of this response, then drops the connection.
    const stop = cut != null ? Math.min(cut, body.length) : body.length;
    for (let off = 0; off < stop; off += 16384) {
      const end = Math.min(off + 16384, stop);
      await new Promise((r) => res.write(body.subarray(off, end), r));
      await new Promise((r) => setTimeout(r, state.chunkDelayMs));
    }
    if (cut != null) { res.destroy(); return; }
    res.end();
  });
  return new Promise((resolve) =>
    server.listen(0, "127.0.0.1", () => resolve({ url: `http://127.0.0.1:${server.address().port}`, state, server })));
}
