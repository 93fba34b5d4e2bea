"""The ``/subtitles`` web page: streams the microphone or a chosen audio file over ``/v1/subtitles`` and shows
the live subtitles. The browser's audio runs at 48 kHz: the page sends float32 samples at the AudioContext's
rate and declares it in the start message (the server resamples). With API keys configured the page is opened as
``/subtitles?token=KEY``: the script takes the key out of the address bar (``history.replaceState``) and sends it
as the WebSocket subprotocol ``specstream.key.<base64url(KEY)>`` beside ``specstream`` (a browser's WebSocket API
can set no header), never in the WebSocket's URL. A ``warning`` event (``falling_behind``: the passes are slower
than the audio) is shown above the status line, with its real-time factor. ``?speed=N`` streams a file N times faster than real time
(tests)."""

SUBTITLES_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>specstream live subtitles</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2em; max-width: 50em; }
 #finals span.final { color: #111; }
 #partial { color: #888; font-style: italic; }
 #subs { font-size: 1.4em; min-height: 4em; border: 1px solid #ccc; padding: .5em; }
 #status { color: #555; font-size: .9em; }
 #warning { color: #8a4b00; background: #fff4e0; padding: .3em .5em; }
 #warning:empty { display: none; }
</style>
</head>
<body>
<h1>Live subtitles</h1>
<p>
 <button id="mic">Microphone</button>
 <input type="file" id="file" accept="audio/*,video/*">
 <button id="play" disabled>Stream file</button>
 <button id="stop" disabled>Stop</button>
</p>
<div id="subs"><span id="finals"></span> <span id="partial"></span></div>
<p id="warning" role="alert"></p>
<p id="status">idle</p>
<script>
"use strict";
const params = new URLSearchParams(location.search);
const speed = Math.max(0.1, parseFloat(params.get("speed") || "1"));
const $ = (id) => document.getElementById(id);
let ws = null, ctx = null, stopper = null;
// the API key: out of the address bar (history, bookmarks, screen shares) and into a subprotocol
const apiKey = params.get("token");
if (apiKey !== null) {
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
}

function base64url(text) {
  let bin = "";
  for (const b of new TextEncoder().encode(text)) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function wsUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}/v1/subtitles`;
}

function openSocket(rate) {
  return new Promise((resolve, reject) => {
    const s = apiKey ? new WebSocket(wsUrl(), ["specstream", "specstream.key." + base64url(apiKey)])
                     : new WebSocket(wsUrl());
    s.binaryType = "arraybuffer";
    s.onopen = () => { s.send(JSON.stringify({type: "start", sample_rate: rate, format: "f32le", language: "en"}));
                       resolve(s); };
    s.onerror = (e) => reject(e);
    s.onmessage = (ev) => {
      const m = JSON.parse(ev.data);
      if (m.type === "final") {
        const span = document.createElement("span");
        span.className = "final";
        span.textContent = m.text + " ";
        span.title = `${m.start_s.toFixed(2)}-${m.end_s.toFixed(2)} s, ${m.latency_ms} ms`;
        $("finals").appendChild(span);
        $("partial").textContent = "";
      } else if (m.type === "partial") {
        $("partial").textContent = m.text;
      } else if (m.type === "warning") {  // e.g. falling_behind: passes slower than the audio (rtf > 1)
        $("warning").textContent = m.message + (m.rtf !== undefined ? ` (real-time factor ${m.rtf})` : "");
        $("warning").dataset.code = m.code || "";
      } else if (m.type === "done") {
        $("status").textContent = "done";
      }
    };
    s.onclose = (ev) => { $("status").textContent += ` (closed ${ev.code}${ev.reason ? ": " + ev.reason : ""})`;
                          $("stop").disabled = true; };
  });
}

function stopStream() {
  if (stopper) { stopper(); stopper = null; }
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: "stop"}));
  $("stop").disabled = true;
}

$("file").onchange = () => { $("play").disabled = !$("file").files.length; };

$("play").onclick = async () => {
  const f = $("file").files[0];
  if (!f) return;
  ctx = ctx || new AudioContext({sampleRate: 48000});
  const buf = await ctx.decodeAudioData(await f.arrayBuffer());
  const rate = buf.sampleRate, x = buf.getChannelData(0);
  ws = await openSocket(rate);
  $("status").textContent = `streaming ${f.name} at ${rate} Hz`;
  $("stop").disabled = false;
  const chunk = Math.round(rate * 0.25);
  let i = 0, cancelled = false;
  stopper = () => { cancelled = true; };
  const t0 = performance.now();
  while (i < x.length && !cancelled) {
    const due = t0 + (i / rate) * 1000 / speed;
    const wait = due - performance.now();
    if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    ws.send(x.slice(i, i + chunk).buffer);
    i += chunk;
  }
  if (!cancelled) stopStream();
};

$("mic").onclick = async () => {
  const stream = await navigator.mediaDevices.getUserMedia({audio: {channelCount: 1}});
  ctx = ctx || new AudioContext({sampleRate: 48000});
  ws = await openSocket(ctx.sampleRate);
  $("status").textContent = `microphone at ${ctx.sampleRate} Hz`;
  $("stop").disabled = false;
  const src = ctx.createMediaStreamSource(stream);
  const proc = ctx.createScriptProcessor(4096, 1, 1);
  proc.onaudioprocess = (e) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(new Float32Array(e.inputBuffer.getChannelData(0)).buffer);
  };
  src.connect(proc); proc.connect(ctx.destination);
  stopper = () => { proc.disconnect(); src.disconnect(); stream.getTracks().forEach((t) => t.stop()); };
};
$("stop").onclick = stopStream;
</script>
</body>
</html>
"""
