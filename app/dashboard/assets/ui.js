// steprecord dashboard: an instance page's bar details on hover and focus, and its live updates.
// The script formats and draws nothing itself: when the event stream says a step changed, it
// fetches the page's changing parts as the server renders them (`data-parts`) and swaps them
// in, so a row added live reads exactly like the others. It only stretches running bars to
// now between two fetches, on the scale the server gave.
(function () {
  "use strict";
  var main = document.getElementById("instance");
  if (!main) return;

  // --- a bar's details, on hover and on keyboard focus --------------------------------
  function showTip(bar) {
    var tip = document.getElementById("tip");
    if (!tip) return;
    tip.textContent = bar.getAttribute("aria-label");
    tip.hidden = false;
    var at = bar.getBoundingClientRect(), below = at.bottom + 6;
    var left = Math.min(at.left, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = Math.max(left, 8) + "px";
    tip.style.top = (below + tip.offsetHeight > window.innerHeight
      ? at.top - tip.offsetHeight - 6 : below) + "px";
  }
  function hideTip() {
    var tip = document.getElementById("tip");
    if (tip) tip.hidden = true;
  }
  function barOf(event) {
    var target = event.target;
    return target instanceof Element && target.matches("rect.bar[aria-label]") ? target : null;
  }
  main.addEventListener("mouseover", function (e) { var b = barOf(e); if (b) showTip(b); });
  main.addEventListener("focusin", function (e) { var b = barOf(e); if (b) showTip(b); });
  main.addEventListener("mouseout", function (e) { if (barOf(e)) hideTip(); });
  main.addEventListener("focusout", function (e) { if (barOf(e)) hideTip(); });
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") hideTip(); });

  if (!window.EventSource) return;

  // --- running bars grow to now, on the server's scale ---------------------------------
  // The server's clock, not this browser's: its `now` when it drew, plus the time since.
  var drawnAt = Date.now();
  function serverNow() {
    var timeline = document.getElementById("timeline");
    return +timeline.dataset.now + (Date.now() - drawnAt);
  }
  function grow() {
    var timeline = document.getElementById("timeline");
    var bars = timeline.querySelectorAll("rect.bar[data-end='']");
    if (!bars.length) return false;
    var now = serverNow(), first = +timeline.dataset.first, perMs = +timeline.dataset.pctPerMs;
    var minBar = +timeline.dataset.minBar, past = now - first > +timeline.dataset.end;
    bars.forEach(function (bar) {
      var width = Math.max((now - bar.dataset.start) * perMs, minBar);
      bar.setAttribute("width", width.toFixed(3) + "%");
    });
    return past;
  }

  // --- the changing parts, fetched again as the server renders them -------------------
  var live = document.getElementById("live");
  var fetching = false, again = false, lastFetch = 0;
  function gone() {
    live.textContent = "deleted: this instance no longer exists";
    live.className = "live gone";
    main.classList.add("gone");
  }
  // At most one fetch at a time, and one every half second: a burst of changes to a large
  // instance costs a few fetches, not one per change.
  var waiting = null;
  function refresh() {
    if (fetching) { again = true; return; }
    var wait = lastFetch + 500 - Date.now();
    if (wait > 0) {
      if (!waiting) waiting = setTimeout(function () { waiting = null; refresh(); }, wait);
      return;
    }
    fetching = true; again = false; lastFetch = Date.now();
    fetch(main.dataset.parts, { credentials: "same-origin" }).then(function (answer) {
      if (answer.status === 404) { gone(); return null; }
      return answer.ok ? answer.text() : null;
    }).then(function (html) {
      if (html === null) return;
      var fresh = new DOMParser().parseFromString(html, "text/html");
      ["counts", "timeline", "steps"].forEach(function (id) {
        var now = document.getElementById(id), next = fresh.getElementById(id);
        if (now && next) now.replaceWith(document.adoptNode(next));
      });
      drawnAt = Date.now();
      if (document.querySelector("#steps tbody tr")) {
        var empty = document.querySelector(".timeline-box .empty");
        if (empty) empty.remove();
      }
      grow();
    }).catch(function () { /* the next change or tick asks again */ }).finally(function () {
      fetching = false;
      if (again) refresh();
    });
  }

  // Once a second: stretch running bars; fetch again when one reaches the scale's end, and
  // every 15 seconds while a step runs (its duration in the table).
  setInterval(function () {
    var past = grow();
    var running = document.querySelector("#timeline rect.bar[data-end='']");
    if (running && (past || Date.now() - lastFetch > 15000)) refresh();
  }, 1000);

  var source = new EventSource(main.dataset.stream);
  source.onopen = function () { live.textContent = "live"; live.className = "live on"; };
  source.onerror = function () {
    if (source.readyState !== EventSource.CLOSED) {
      live.textContent = "reconnecting…";
      live.className = "live";
      return;
    }
    // The stream was refused for good: the instance may have been deleted.
    fetch(location.href, { credentials: "same-origin" }).then(function (answer) {
      if (answer.status === 404) {
        gone();
      } else {
        live.textContent = "not live: reload the page";
        live.className = "live";
      }
    });
  };
  source.addEventListener("record", function (event) {
    var rec;
    try { rec = JSON.parse(event.data); } catch (e) { return; }
    if (!rec || typeof rec.step_slug !== "string") return;
    var shown = null;
    document.querySelectorAll("#steps tbody tr").forEach(function (tr) {
      if (tr.dataset.step === rec.step_slug) shown = tr;
    });
    if (shown && shown.dataset.updated === rec.updated_at) return;  // as rendered
    refresh();
  });
})();
