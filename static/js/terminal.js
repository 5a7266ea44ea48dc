// The web terminal of a terminal session (templates/interactive/terminal.html): xterm.js over a
// WebSocket to the session proxy. Output arrives as binary frames; keys and sizes go up as JSON.
(function () {
  "use strict";
  const el = document.getElementById("terminal");
  const status = document.getElementById("terminal-status");
  if (!el || !window.Terminal) return;
  const term = new window.Terminal({cursorBlink: true, fontSize: 14,
                                     theme: {background: "#111111", foreground: "#e8e8e8"}});
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(el);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const ws = new WebSocket(scheme + location.host + el.dataset.socket);
  ws.binaryType = "arraybuffer";
  const send = (msg) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(msg)); };
  const resize = () => { fit.fit(); send({type: "resize", cols: term.cols, rows: term.rows}); };
  ws.onopen = () => { status.textContent = "connected"; resize(); term.focus(); };
  ws.onmessage = (ev) => term.write(new Uint8Array(ev.data));
  ws.onclose = () => { status.textContent = "disconnected"; term.write("\r\n[connection closed]\r\n"); };
  term.onData((data) => send({type: "input", data: data}));
  window.addEventListener("resize", resize);
})();
