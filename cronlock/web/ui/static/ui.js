// cronlock's dashboard: countdowns, and the page's data refreshed in place while it is open.
// Everything works without it: the pages are plain HTML and forms.
(function () {
  "use strict";
  var body = document.body;
  var offset = 0; // the server's clock minus ours, from the page's data-now

  function setClock(doc) {
    var now = Date.parse(doc.body.getAttribute("data-now") || "");
    if (!isNaN(now)) offset = now - Date.now();
  }

  function words(seconds) {
    if (seconds < 1) return Math.round(seconds * 1000) + " ms";
    if (seconds < 90) return seconds.toFixed(1) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    if (seconds < 2 * 86400) return (seconds / 3600).toFixed(1) + " h";
    return (seconds / 86400).toFixed(1) + " days";
  }

  function tick() {
    var now = Date.now() + offset;
    document.querySelectorAll("time[data-countdown]").forEach(function (el) {
      var left = (Date.parse(el.getAttribute("datetime")) - now) / 1000;
      el.textContent = left >= 0 ? "in " + words(Math.floor(left)) : words(-left) + " ago";
    });
    document.querySelectorAll("time[data-ago]").forEach(function (el) {
      var since = (now - Date.parse(el.getAttribute("datetime"))) / 1000;
      el.textContent = words(Math.max(0, since)) + " ago";
    });
  }

  function busy() {
    // Never swap the page under someone filling in a form.
    var active = document.activeElement;
    return (active && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName)) ||
      document.querySelector("details[open]") !== null;
  }

  function refresh() {
    if (busy()) return;
    fetch(location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.redirected) { location.reload(); return null; } // the session ended
        return r.ok ? r.text() : null;
      })
      .then(function (html) {
        if (!html || busy()) return;
        var doc = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live]").forEach(function (el) {
          var name = el.getAttribute("data-live");
          var fresh = doc.querySelector('[data-live="' + name + '"]');
          if (fresh) el.replaceWith(document.importNode(fresh, true));
        });
        setClock(doc);
        tick();
        body.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function () { /* offline for a moment: the next round tries again */ });
  }

  setClock(document);
  tick();
  setInterval(tick, 1000);
  var every = parseFloat(body.getAttribute("data-refresh") || "0");
  if (every > 0) setInterval(refresh, every * 1000);
})();
