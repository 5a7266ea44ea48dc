/* What every chart of the portal shares (the console's and the job page's), on the vendored uPlot:
 * times in 24-hour UTC like the rest of the pages, x ticks spaced so their labels never
 * overlap, and axes that name their unit. Loaded before the page's own chart script. */
(function () {
  "use strict";
  if (typeof uPlot === "undefined") return;

  var COLORS = ["#1f5fbf", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490", "#a16207", "#4d7c0f"];

  var WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  function pad(n) { return n < 10 ? "0" + n : "" + n; }

  // uPlot places time ticks on calendar boundaries of this clock: UTC, not the browser's zone.
  function utc(ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); }

  // Tick labels from the tick spacing uPlot chose: seconds only when ticks are seconds apart, the
  // date under the first tick and under each midnight, the date alone when ticks are days apart.
  function timeLabels(u, splits, axisIdx, space, incr) {
    var lastDay = null;
    return splits.map(function (ts, i) {
      var d = new Date(ts * 1e3);
      var day = pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate());
      if (incr >= 86400) return day;
      var hm = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
      if (incr < 60) hm += ":" + pad(d.getUTCSeconds());
      var label = (i === 0 || day !== lastDay) ? hm + "\n" + day : hm;
      lastDay = day;
      return label;
    });
  }

  function stamp(ts) {
    if (ts == null) return "–";
    var d = new Date(ts * 1e3);
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " +
      pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + " UTC";
  }

  function number(v, digits) {
    if (v == null) return "–";
    return v.toLocaleString("en", {maximumFractionDigits: digits == null ? 2 : digits});
  }

  // An x axis of times: 24-hour UTC labels at least 90 px apart (two lines when the date shows).
  function timeAxis() {
    return {space: 90, size: 48, values: timeLabels, label: "Time (UTC)", labelSize: 18};
  }

  // A y axis that says its unit; `format` turns a tick value into text.
  function valueAxis(label, opts) {
    opts = opts || {};
    var format = opts.format || function (v) { return number(v); };
    var axis = {label: label, labelSize: 18, size: opts.size || 64, side: opts.side == null ? 3 : opts.side,
                scale: opts.scale || "y", grid: {show: opts.grid !== false},
                values: function (u, splits) { return splits.map(format); }};
    if (opts.whole) axis.incrs = WHOLE;  // counts (GPUs, jobs): no tick at 0.25 of a job
    return axis;
  }

  function width(el) { return Math.max(280, Math.floor(el.clientWidth) - 16); }

  // A chart inside `el` (a <figure>), as wide as its box, redrawn at the new width on resize.
  function make(el, opts, data) {
    opts.width = width(el);
    opts.height = opts.height || 220;
    opts.tzDate = utc;
    var chart = new uPlot(opts, data, el);
    var timer = null;
    window.addEventListener("resize", function () {
      window.clearTimeout(timer);
      timer = window.setTimeout(function () { chart.setSize({width: width(el), height: opts.height}); }, 100);
    });
    return chart;
  }

  window.gpCharts = {COLORS: COLORS, timeAxis: timeAxis, timeLabels: timeLabels, valueAxis: valueAxis, make: make,
                     stamp: stamp, number: number};
})();
