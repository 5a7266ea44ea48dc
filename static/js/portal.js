/* Small enhancements; every page works without this file. */
(function () {
  "use strict";

  // Copy buttons: <button data-copy="#input-id">. Falls back to selecting the text.
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var field = document.querySelector(button.getAttribute("data-copy"));
    if (!field) return;
    var status = document.getElementById(button.getAttribute("aria-describedby") || "");
    var done = function (text) { if (status) status.textContent = text; };
    field.select();
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(field.value).then(function () { done("Copied."); },
        function () { done("Press Ctrl+C to copy the selected token."); });
    } else {
      try { document.execCommand("copy"); done("Copied."); } catch (e) { done("Press Ctrl+C to copy."); }
    }
  });

  // Keep a live log scrolled to the end while the reader is at the end.
  var pinned = true;
  document.addEventListener("scroll", function (event) {
    var log = event.target;
    if (log && log.id === "log-text") pinned = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
  }, true);
  document.addEventListener("htmx:oobAfterSwap", function () {
    var log = document.getElementById("log-text");
    if (log && pinned) log.scrollTop = log.scrollHeight;
  });
  document.addEventListener("DOMContentLoaded", function () {
    var log = document.getElementById("log-text");
    if (log) log.scrollTop = log.scrollHeight;
  });

  // Bulk cancel: "select all" checkbox for the rows on this page.
  document.addEventListener("change", function (event) {
    if (event.target.id !== "select-all") return;
    document.querySelectorAll("#job-rows input[name=ids]").forEach(function (box) {
      box.checked = event.target.checked;
    });
  });
})();
