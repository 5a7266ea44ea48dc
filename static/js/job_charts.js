/* Per-GPU utilization, memory and power charts on the job page (uPlot through static/js/charts.js).
 * Until the charts exist, each request asks for the attempt's minute rollups since it got its GPUs (?history=1), so
 * the x axis starts at the job's start; later polls of the same endpoint append each GPU's latest
 * sample while the page is open. Without JavaScript the page's table shows the latest samples. */
(function () {
  "use strict";
  var root = document.getElementById("gpu-charts");
  if (!root || !window.gpCharts) return;
  var C = window.gpCharts;
  var url = root.getAttribute("data-url");
  var live = root.getAttribute("data-live") === "true";
  var maxPoints = 2880;  // a day of history by the minute, then an hour of polls every 5 s
  // max: the sample field that gives the y axis its ceiling (a fixed number for utilization).
  var metrics = [
    {key: "utilization", title: "Utilization", unit: "%", max: 100, digits: 0},
    {key: "memory_used_mb", title: "Memory used", unit: "MB", max: "memory_total_mb", digits: 0},
    {key: "power_w", title: "Power", unit: "W", max: "power_limit_w", digits: 1},
  ];
  var ceilings = {};
  var times = [], series = {}, gpus = [], charts = {}, lastTs = {};
  var started = null, ended = null;

  // The node's name only when the job spans nodes: eight long legend entries crowd a small chart.
  function label(g) {
    var nodes = gpus.map(function (x) { return x.node; });
    var one = nodes.every(function (n) { return n === nodes[0]; });
    return (one ? "" : g.node + "/") + "gpu" + g.index;
  }

  function build() {
    root.hidden = false;
    // All three boxes first, so each chart takes its box's width once the row is laid out.
    var boxes = metrics.map(function (m) {
      var box = document.createElement("figure");
      box.className = "chart small";
      var caption = document.createElement("figcaption");
      caption.textContent = m.title + " (" + m.unit + ")";
      box.appendChild(caption);
      root.appendChild(box);
      return box;
    });
    metrics.forEach(function (m, k) {
      charts[m.key] = C.make(boxes[k], {
        height: 200,
        series: [{label: "Time", value: function (u, v) { return C.stamp(v); }}].concat(gpus.map(function (g, i) {
          return {label: label(g), stroke: C.COLORS[i % C.COLORS.length], width: 2, spanGaps: false,
                  value: function (u, v) { return v == null ? "–" : C.number(v, m.digits) + " " + m.unit; }};
        })),
        axes: [C.timeAxis(), C.valueAxis(m.unit)],
        scales: {
          // From the job's start to now (or its end); set by draw().
          x: {time: true, auto: false},
          y: {range: function (u, min, max) { return [0, Math.max(ceilings[m.key] || 0, max || 0, 1)]; }},
        },
      }, [[]].concat(gpus.map(function () { return []; })));
    });
  }

  function draw() {
    var now = Date.now() / 1000;
    var end = ended || Math.max(now, times.length ? times[times.length - 1] : now);
    // The job's start on the left; at least five minutes wide so a young job's ticks stay readable.
    var start = started || times[0] || now;
    if (end - start < 300) end = start + 300;
    metrics.forEach(function (m) {
      var data = [times.slice()];
      gpus.forEach(function (g) { data.push(series[g.uuid][m.key].slice()); });
      charts[m.key].setData(data, false);
      charts[m.key].setScale("x", {min: start, max: end});
    });
  }

  function addHistory(history) {
    if (!history || !history.t.length) return;
    history.t.forEach(function (t) { times.push(t); });
    gpus.forEach(function (g) {
      var h = history.gpus[g.uuid];
      metrics.forEach(function (m) {
        var values = h ? h[m.key] : history.t.map(function () { return null; });
        values.forEach(function (v) { series[g.uuid][m.key].push(v); });
      });
    });
  }

  function updateTable(g) {
    var row = document.getElementById("gpu-" + g.uuid);
    if (!row || !g.sample) return;
    ["utilization", "memory_used_mb", "power_w", "temperature_c"].forEach(function (k) {
      var cell = row.querySelector("[data-k=" + k + "]");
      if (cell && g.sample[k] != null) cell.textContent = g.sample[k];
    });
  }

  function poll() {
    // History until the charts exist (a queued job gets its GPUs later), then latest samples only.
    fetch(gpus.length ? url : url + "?history=1", {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (body) {
        if (!body) return;
        live = body.live;
        started = body.started;
        ended = body.ended;
        if (!body.gpus.length) return;
        if (!gpus.length) {
          gpus = body.gpus;
          gpus.forEach(function (g) { series[g.uuid] = {utilization: [], memory_used_mb: [], power_w: []}; });
          build();
          addHistory(body.history);
        }
        var fresh = body.gpus.some(function (g) { return g.sample && g.sample.ts !== lastTs[g.uuid]; });
        if (fresh && !ended) {
          times.push(Date.now() / 1000);
          body.gpus.forEach(function (g) {
            if (!series[g.uuid]) return;
            metrics.forEach(function (m) {
              series[g.uuid][m.key].push(g.sample ? g.sample[m.key] : null);
            });
          });
          while (times.length > maxPoints) {
            times.shift();
            gpus.forEach(function (g) { metrics.forEach(function (m) { series[g.uuid][m.key].shift(); }); });
          }
        }
        body.gpus.forEach(function (g) {
          metrics.forEach(function (m) {
            var ceiling = typeof m.max === "number" ? m.max : (g.sample && g.sample[m.max]);
            if (ceiling) ceilings[m.key] = Math.max(ceilings[m.key] || 0, ceiling);
          });
          if (g.sample) lastTs[g.uuid] = g.sample.ts;
          updateTable(g);
        });
        draw();
      })
      .catch(function () {})
      .finally(function () { if (live) window.setTimeout(poll, 5000); });
  }

  poll();
})();
