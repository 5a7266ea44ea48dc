/* Per-GPU utilization, memory and power charts (uPlot) on the job page.
 * The portal keeps only each GPU's latest sample (no history store yet), so the series are
 * built here from successive polls of the metrics endpoint while the page is open.
 * Without JavaScript the page's table shows the samples as of page load. */
(function () {
  "use strict";
  var root = document.getElementById("gpu-charts");
  if (!root || typeof uPlot === "undefined") return;
  var url = root.getAttribute("data-url");
  var live = root.getAttribute("data-live") === "true";
  var maxPoints = 720;  // an hour at one point per 5 s
  // max: the sample field that gives the y axis its ceiling (a fixed number for utilization).
  var metrics = [
    {key: "utilization", title: "Utilization", unit: "%", max: 100},
    {key: "memory_used_mb", title: "Memory used", unit: "MB", max: "memory_total_mb"},
    {key: "power_w", title: "Power", unit: "W", max: "power_limit_w"},
  ];
  var ceilings = {};
  var colors = ["#1f5fbf", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490", "#a16207", "#4d7c0f"];
  var times = [], series = {}, gpus = [], charts = {}, lastTs = {};

  function label(g) { return g.node + "/gpu" + g.index; }

  function build() {
    root.hidden = false;
    // Three side by side when there is room (each figure adds ~20 px of padding and border).
    var width = Math.max(280, Math.floor((root.clientWidth - 2 * 16) / 3) - 20);
    metrics.forEach(function (m) {
      var box = document.createElement("figure");
      box.className = "chart";
      var caption = document.createElement("figcaption");
      caption.textContent = m.title + " (" + m.unit + ")";
      box.appendChild(caption);
      root.appendChild(box);
      var opts = {
        width: width, height: 180,
        series: [{}].concat(gpus.map(function (g, i) {
          return {label: label(g), stroke: colors[i % colors.length], width: 2,
                  value: function (u, v) { return v == null ? "–" : v + " " + m.unit; }};
        })),
        axes: [{}, {size: 60}],
        scales: {
          // Set by draw(): uPlot's own range for a single point would span years.
          x: {time: true, auto: false},
          y: {range: function (u, min, max) { return [0, Math.max(ceilings[m.key] || 0, max || 0, 1)]; }},
        },
      };
      charts[m.key] = new uPlot(opts, [[]].concat(gpus.map(function () { return []; })), box);
    });
  }

  function draw() {
    metrics.forEach(function (m) {
      var data = [times.slice()];
      gpus.forEach(function (g) { data.push(series[g.uuid][m.key].slice()); });
      charts[m.key].setData(data);
      // At least the last five minutes, so the first few points sit on a readable time axis.
      var now = Date.now() / 1000;
      charts[m.key].setScale("x", {min: Math.min(times[0] || now, now - 300), max: now + 5});
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
    fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (body) {
        if (!body || !body.gpus.length) return;
        if (!gpus.length) {
          gpus = body.gpus;
          gpus.forEach(function (g) { series[g.uuid] = {utilization: [], memory_used_mb: [], power_w: []}; });
          build();
        }
        var fresh = body.gpus.some(function (g) { return g.sample && g.sample.ts !== lastTs[g.uuid]; });
        if (fresh) {
          times.push(Date.now() / 1000);
          body.gpus.forEach(function (g) {
            if (!series[g.uuid]) return;
            metrics.forEach(function (m) {
              series[g.uuid][m.key].push(g.sample ? g.sample[m.key] : null);
              var ceiling = typeof m.max === "number" ? m.max : (g.sample && g.sample[m.max]);
              if (ceiling) ceilings[m.key] = Math.max(ceilings[m.key] || 0, ceiling);
            });
            if (g.sample) lastTs[g.uuid] = g.sample.ts;
            updateTable(g);
          });
          if (times.length > maxPoints) {
            times.shift();
            gpus.forEach(function (g) { metrics.forEach(function (m) { series[g.uuid][m.key].shift(); }); });
          }
          draw();
        }
        live = body.live;
      })
      .catch(function () {})
      .finally(function () { if (live) window.setTimeout(poll, 5000); });
  }

  poll();
})();
