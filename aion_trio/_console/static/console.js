// aion-trio console: live parts over server-sent events, confirmations, the JSON editor.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (live && live.dataset.stream && window.EventSource) {
    var source = new EventSource(live.dataset.stream);
    source.addEventListener("update", function (event) {
      live.innerHTML = event.data;
      live.dataset.updates = String(Number(live.dataset.updates || "0") + 1);
    });
    source.addEventListener("open", function () { document.body.dataset.live = "on"; });
    source.addEventListener("error", function () { document.body.dataset.live = "retrying"; });
    window.addEventListener("pagehide", function () { source.close(); });
  }
  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (!window.confirm(form.dataset.confirm)) { event.preventDefault(); }
    });
  });
  document.querySelectorAll("textarea[data-json]").forEach(function (area) {
    var form = area.form;
    var error = form.querySelector(".json-error");
    var button = form.querySelector("button[type=submit]");
    function check() {
      var text = area.value.trim();
      try {
        JSON.parse(text === "" ? "null" : text);
        error.textContent = "";
        area.classList.remove("invalid");
        button.disabled = false;
      } catch (e) {
        error.textContent = "not JSON: " + e.message;
        area.classList.add("invalid");
        button.disabled = true;
      }
    }
    area.addEventListener("input", check);
    check();
  });
  var filters = document.getElementById("filters");
  if (filters) {
    filters.addEventListener("submit", function () {
      filters.querySelectorAll("input[type=text], input:not([type])").forEach(function (input) {
        if (input.value.trim() === "") { input.disabled = true; }
      });
    });
  }
})();
