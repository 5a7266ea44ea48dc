/* The admin console's charts (uPlot through static/js/charts.js). The numbers come from the page's
 * <script type="application/json" id="console-data"> (data, never executed); every chart has a
 * table of the same numbers under it for readers without JavaScript. */
(function () {
  "use strict";
  var source = document.getElementById("console-data");
  if (!source || !window.gpCharts) return;
  var C = window.gpCharts;
  var data = JSON.parse(source.textContent);
  var f = data.fleet;

  function figure(name) { return document.querySelector('[data-chart="' + name + '"]'); }

  function line(label, color, unit, digits, opts) {
    var s = {label: label, stroke: color, width: 2,
             value: function (u, v) { return v == null ? "–" : C.number(v, digits) + " " + unit; }};
    for (var k in (opts || {})) s[k] = opts[k];
    return s;
  }

  var timeSeries = {label: "Time", value: function (u, v) { return C.stamp(v); }};
  // The whole range on the x axis, also when rollups cover only part of it.
  var xScale = {time: true, range: function () { return [data.start, data.end]; }};

  function percent(part) {
    return part.map(function (v, i) { return f.gpus[i] ? Math.round(1000 * v / f.gpus[i]) / 10 : null; });
  }

  var el = figure("fleet-gpus");
  if (el) {
    C.make(el, {
      scales: {x: xScale, y: {range: function (u, min, max) { return [0, Math.max(1, max)]; }}},
      series: [timeSeries,
               line("GPUs", "#6b7280", "GPUs", 0, {dash: [6, 4], points: {show: false}}),
               line("Allocated", C.COLORS[0], "GPUs", 2, {fill: "rgba(31,95,191,.08)", points: {show: false}}),
               line("Used", C.COLORS[2], "GPUs", 2, {points: {show: false}})],
      axes: [C.timeAxis(), C.valueAxis("GPUs", {whole: true})],
    }, [f.t, f.gpus, f.allocated, f.used]);
  }

  el = figure("fleet-pct");
  if (el) {
    C.make(el, {
      scales: {x: xScale, y: {range: [0, 100]}},
      series: [timeSeries, line("Allocated", C.COLORS[0], "%", 1, {points: {show: false}}),
               line("Used", C.COLORS[2], "%", 1, {points: {show: false}})],
      axes: [C.timeAxis(), C.valueAxis("% of the fleet", {format: function (v) { return v + " %"; }})],
    }, [f.t, percent(f.allocated), percent(f.used)]);
  }

  el = figure("queue");
  if (el) {
    C.make(el, {
      scales: {x: xScale, y: {range: function (u, min, max) { return [0, Math.max(1, max)]; }},
               min: {range: function (u, min, max) { return [0, Math.max(1, max || 0)]; }}},
      series: [timeSeries, line("Queued", C.COLORS[1], "jobs", 0, {points: {show: false}}),
               line("Mean wait", C.COLORS[3], "min", 1, {scale: "min", spanGaps: true})],
      axes: [C.timeAxis(), C.valueAxis("Queued jobs", {whole: true}),
             C.valueAxis("Mean wait (min)", {scale: "min", side: 1, grid: false})],
    }, [f.t, f.queued, f.wait_min]);
  }

  el = figure("revenue");
  if (el && data.revenue.t.length) {
    var r = data.revenue;
    var day = 86400;
    C.make(el, {
      // The whole month, a bar per day.
      scales: {x: {time: true, range: function () { return [r.first - day / 2, r.last + day / 2]; }},
               y: {range: function (u, min, max) { return [0, Math.max(1, max) * 1.1]; }}},
      series: [{label: "Day", value: function (u, v) { return v == null ? "–" : C.stamp(v).slice(0, 10); }},
               {label: "Revenue", stroke: C.COLORS[0], fill: "rgba(31,95,191,.55)", width: 1,
                paths: uPlot.paths.bars({size: [0.7, 48]}), points: {show: false},
                value: function (u, v) { return v == null ? "–" : C.number(v, 2) + " " + data.currency; }}],
      axes: [C.timeAxis(), C.valueAxis(data.currency, {size: 72})],
    }, [r.t, r.amount]);
  }
})();
