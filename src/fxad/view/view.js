/* fxad.view: linking of the code panes, the inspector, the memory chart and the graph.
   Everything is looked up inside one root element, so several views can share a page. */
function fxvInit(root) {
  "use strict";
  if (!root || root.getAttribute("data-fxv-ready")) return;
  root.setAttribute("data-fxv-ready", "1");
  var dataEl = root.querySelector("script.fxv-data");
  if (!dataEl) return;
  var D = JSON.parse(dataEl.textContent);
  var $ = function (sel) { return root.querySelector(sel); };
  var $$ = function (sel) { return Array.prototype.slice.call(root.querySelectorAll(sel)); };

  var L = {}, B = {}, lineBox = {}, blockBox = {}, boxById = {};
  $$(".fxv-ln[data-l]").forEach(function (e) { L[+e.getAttribute("data-l")] = e; });
  $$(".fxv-blk[data-b]").forEach(function (e) { B[+e.getAttribute("data-b")] = e; });
  $$(".fxv-box").forEach(function (g) {
    boxById[g.getAttribute("data-box")] = g;
    (g.getAttribute("data-lines") || "").split(" ").forEach(function (x) { if (x) lineBox[+x] = g; });
    (g.getAttribute("data-blocks") || "").split(" ").forEach(function (x) { if (x) blockBox[+x] = g; });
  });
  var edges = $$(".fxv-e");
  var insp = $(".fxv-insp");
  var hint = insp ? insp.innerHTML : "";
  var fwdScroll = $(".fxv-pane-fwd .fxv-scroll"), bwdScroll = $(".fxv-pane-bwd .fxv-scroll");
  var pinned = null, marked = [];

  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function fmt(n) {
    var u = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < 3) { n /= 1024; i++; }
    return i ? n.toFixed(1) + " " + u[i] : n + " B";
  }
  function mark(el, cls) { if (el) { el.classList.add(cls); marked.push([el, cls]); } }
  function clear() {
    marked.forEach(function (p) { p[0].classList.remove(p[1]); });
    marked = [];
    cursor(null);
  }
  function reveal(el, scroller) {
    if (!el || !scroller) return;
    var r = el.getBoundingClientRect(), s = scroller.getBoundingClientRect();
    if (r.top < s.top + 4 || r.bottom > s.bottom - 4) {
      scroller.scrollTop += (r.top - s.top) - Math.max(24, s.height / 3);
    }
  }
  function markBox(g) {
    if (!g) return;
    mark(g, "fxv-hl-box");
    var id = g.getAttribute("data-box");
    edges.forEach(function (e) {
      if (e.getAttribute("data-u") === id || e.getAttribute("data-v") === id) mark(e, "fxv-hl-e");
    });
  }

  // ------------------------------------------------------------ inspector
  function sourceHTML(si) {
    if (si === null || si === undefined || !D.sources[si]) {
      return '<div class="fxv-insp-k">your source</div><div class="fxv-srcfile">no source line recorded</div>';
    }
    var s = D.sources[si];
    var rows = s.c.map(function (c) {
      return '<div class="fxv-sl' + (c[0] === s.l ? " fxv-sl-hit" : "") + '"><span>' + c[0] +
        "</span><span>" + esc(c[1]) + "</span></div>";
    }).join("");
    return '<div class="fxv-insp-k">your source</div><div class="fxv-srcfile"><b>' + esc(s.f) +
      "</b> in <code>" + esc(s.fn) + '</code></div><div class="fxv-srcbox">' + rows + "</div>";
  }
  function pinTag() { return pinned ? '<span class="fxv-pin">pinned · Esc</span>' : ""; }
  function showBlock(b) {
    if (!insp) return;
    var blk = D.blocks[b];
    var reads = blk.rs.length ? "reads saved " + blk.rs.map(function (n) {
      return "<code>" + esc(n) + "</code>";
    }).join(", ") + " (" + fmt(blk.sb) + ")" : (blk.kind === "backward" ? "reads no saved tensor" : "");
    var outs = blk.o.length ? "computes " + blk.o.map(function (o) {
      return "<code>" + esc(o[0]) + "</code> " + esc(o[1]);
    }).join(", ") : "";
    if (outs && reads) outs += " · ";
    var rec = blk.rc.length ? " · recomputes <code>" + blk.rc.map(esc).join("</code>, <code>") + "</code>" : "";
    insp.innerHTML = '<div class="fxv-insp-main"><div class="fxv-insp-k">' + esc(blk.kind) +
      " block · " + blk.l.length + " line" + (blk.l.length === 1 ? "" : "s") + pinTag() +
      '</div><div class="fxv-insp-what"><code>' + esc(blk.h) + "</code></div>" +
      '<div class="fxv-insp-meta">' + outs + reads + rec + "</div></div><div>" + sourceHTML(blk.s) + "</div>";
  }
  function showLine(l) {
    if (!insp) return;
    var ln = D.lines[l];
    var meta = [];
    if (ln.sh) meta.push("<code>" + esc(ln.sh) + "</code> · " + fmt(ln.by));
    meta.push(fmt(ln.m) + " alive after this line");
    if (ln.sv) {
      var sv = D.saved[ln.n];
      meta.push('<span class="fxv-role fxv-role-saved">saved</span> read by ' +
        (sv && sv.rb.length ? sv.rb.map(function (b) { return "<code>∂ " + esc(D.blocks[b].k) + "</code>"; }).join(", ") : "the backward"));
    }
    if (ln.g) meta.push('<span class="fxv-role fxv-role-grad">' + esc(ln.g) + "</span>");
    if (ln.rc) meta.push('<span class="fxv-role fxv-role-bwd">recomputed</span> from forward <code>' + esc(ln.rc) + "</code>");
    var fb = D.fwdBlocks[l] || [];
    if (fb.length) meta.push("differentiated by " + fb.map(function (b) { return "<code>" + esc(D.blocks[b].h.split(":")[0]) + "</code>"; }).join(", "));
    var where = ln.p === "f" ? "forward" : (ln.b !== null ? D.blocks[ln.b].kind : "derivative");
    insp.innerHTML = '<div class="fxv-insp-main"><div class="fxv-insp-k">' + where + " line " + (l + 1) +
      (ln.n ? " · <code>" + esc(ln.n) + "</code>" : "") + pinTag() + '</div><div class="fxv-insp-what"><code>' +
      esc(ln.tx) + '</code></div><div class="fxv-insp-meta">' + meta.join(" · ") + "</div></div><div>" +
      sourceHTML(ln.s !== null ? ln.s : (ln.b !== null ? D.blocks[ln.b].s : null)) + "</div>";
  }

  // ------------------------------------------------------------ focus
  function focusBlock(b, from, self) {
    var blk = D.blocks[b];
    if (!blk) return;
    mark(B[b], "fxv-hl-block");
    if (self !== undefined) mark(L[self], "fxv-hl-self");
    blk.t.forEach(function (t) { mark(L[t], "fxv-hl-target"); markBox(lineBox[t]); });
    blk.rs.forEach(function (n) { var s = D.saved[n]; if (s && s.l !== null && blk.t.indexOf(s.l) < 0) mark(L[s.l], "fxv-hl-saved"); });
    markBox(blockBox[b]);
    if (from !== "fwd" && blk.t.length) reveal(L[blk.t[0]], fwdScroll);
    if (from !== "bwd") reveal(B[b], bwdScroll);
    cursor(self !== undefined ? self : blk.l[blk.l.length - 1]);
    if (self !== undefined && from === "mem") showLine(self); else showBlock(b);
  }
  function focusLine(l, from, ref) {
    var ln = D.lines[l];
    if (!ln) return;
    if (ln.b !== null && ln.b !== undefined) {
      focusBlock(ln.b, from, l);
      if (ln.rc && D.nodeLine[ln.rc] !== undefined) mark(L[D.nodeLine[ln.rc]], "fxv-hl-def");
      refDef(ref);
      return;
    }
    mark(L[l], "fxv-hl-self");
    markBox(lineBox[l]);
    var fb = D.fwdBlocks[l] || [];
    fb.forEach(function (b) { mark(B[b], "fxv-hl-block"); markBox(blockBox[b]); });
    if (ln.sv && D.saved[ln.n]) D.saved[ln.n].rl.forEach(function (r) { mark(L[r], "fxv-hl-reader"); });
    if (from !== "bwd" && fb.length) reveal(B[fb[0]], bwdScroll);
    if (from !== "fwd" && ln.p === "f") reveal(L[l], fwdScroll);
    if (from !== "bwd" && ln.p === "b") reveal(L[l], bwdScroll);
    refDef(ref);
    cursor(l);
    showLine(l);
  }
  function refDef(ref) {
    if (!ref) return;
    var d = D.nodeLine[ref];
    if (d !== undefined) mark(L[d], "fxv-hl-def");
  }
  function focus(target, from, ref) {
    clear();
    if (!target) { if (insp) insp.innerHTML = hint; return; }
    if (target[0] === "b") focusBlock(target[1], from); else focusLine(target[1], from, ref);
  }

  // ------------------------------------------------------------ memory cursor
  var chart = $(".fxv-mem-chart svg");
  var cur = chart && chart.querySelector(".fxv-m-cursor"), curLab = chart && chart.querySelector(".fxv-m-curlab");
  function cursor(l) {
    if (!cur) return;
    if (l === null || l === undefined) { cur.classList.remove("fxv-on"); curLab.classList.remove("fxv-on"); return; }
    var x0 = +chart.getAttribute("data-x0"), dx = +chart.getAttribute("data-dx");
    var x = x0 + l * dx;
    cur.setAttribute("x1", x); cur.setAttribute("x2", x);
    curLab.setAttribute("x", Math.min(x + 5, +chart.getAttribute("data-w") - 140));
    curLab.textContent = "line " + (l + 1) + ": " + fmt(D.lines[l].m);
    cur.classList.add("fxv-on"); curLab.classList.add("fxv-on");
  }

  // ------------------------------------------------------------ events
  function targetOf(el) {
    var ln = el.closest(".fxv-ln");
    if (ln && ln.hasAttribute("data-l")) return ["l", +ln.getAttribute("data-l")];
    var bh = el.closest(".fxv-blk");
    if (bh) return ["b", +bh.getAttribute("data-b")];
    var box = el.closest(".fxv-box");
    if (box) {
      var bl = box.getAttribute("data-blocks");
      if (bl) return ["b", +bl.split(" ")[0]];
      var ls = box.getAttribute("data-lines").split(" ");
      var n = D.nodeLine[box.getAttribute("data-box").slice(2)];
      return ["l", n !== undefined ? n : +ls[0]];
    }
    var row = el.closest(".fxv-row");
    if (row && row.hasAttribute("data-l")) return ["l", +row.getAttribute("data-l")];
    return null;
  }
  function fromOf(el) {
    if (el.closest(".fxv-pane-fwd")) return "fwd";
    if (el.closest(".fxv-pane-bwd")) return "bwd";
    if (el.closest(".fxv-mem-chart")) return "mem";
    return "other";
  }
  root.addEventListener("mouseover", function (ev) {
    if (pinned || dragging) return;
    var t = targetOf(ev.target);
    if (!t) return;
    var ref = ev.target.closest(".fxv-t-ref");
    focus(t, fromOf(ev.target), ref ? ref.getAttribute("data-r") : null);
  });
  root.addEventListener("mouseleave", function () { if (!pinned) focus(null); });
  root.addEventListener("click", function (ev) {
    if (moved) return;
    var t = targetOf(ev.target);
    if (!t) return;
    if (pinned && pinned[0] === t[0] && pinned[1] === t[1]) { pinned = null; focus(t, fromOf(ev.target)); return; }
    pinned = null;
    var inGraph = !!ev.target.closest(".fxv-graph-vp");
    focus(t, inGraph ? "other" : fromOf(ev.target));
    pinned = t;
    if (t[0] === "b") showBlock(t[1]); else showLine(t[1]);
    if (!inGraph) center(t[0] === "b" ? blockBox[t[1]] : lineBox[t[1]]);
  });
  root.setAttribute("tabindex", "-1");
  root.addEventListener("keydown", function (ev) {
    if (ev.key === "Escape") { pinned = null; focus(null); }
    else if ((ev.key === "f" || ev.key === "F") && vp) fit("width");
  });
  if (chart) {
    var hit = chart.querySelector(".fxv-m-hit");
    hit.addEventListener("mousemove", function (ev) {
      if (pinned) return;
      var pt = chart.createSVGPoint(); pt.x = ev.clientX; pt.y = ev.clientY;
      var p = pt.matrixTransform(chart.getScreenCTM().inverse());
      var x0 = +chart.getAttribute("data-x0"), dx = +chart.getAttribute("data-dx");
      var l = Math.max(0, Math.min(D.lines.length - 1, Math.round((p.x - x0) / dx)));
      focus(["l", l], "mem");
    });
  }

  // ------------------------------------------------------------ graph pan and zoom
  var vp = $(".fxv-graph-vp"), svg = vp && vp.querySelector("svg");
  var view = null, dragging = false, moved = false, start = null;
  function apply() { svg.setAttribute("viewBox", view.x + " " + view.y + " " + view.w + " " + view.h); }
  function fit(mode) {
    var W = +svg.getAttribute("data-w"), H = +svg.getAttribute("data-h");
    var r = vp.getBoundingClientRect();
    if (!r.width || !r.height) return;
    var s = mode === "all" ? Math.max(W / r.width, H / r.height) : Math.max(W / r.width, 1);
    view = { x: 0, y: 0, w: r.width * s, h: r.height * s };
    if (mode === "all" || view.w > W) view.x = (W - view.w) / 2;  // center what is smaller
    if (mode === "all") view.y = (H - view.h) / 2;
    apply();
  }
  function zoom(f, cx, cy) {
    var r = vp.getBoundingClientRect();
    var W = +svg.getAttribute("data-w");
    var nw = Math.max(W * 0.04, Math.min(W * 6, view.w * f)), k = nw / view.w;
    var px = view.x + (cx / r.width) * view.w, py = view.y + (cy / r.height) * view.h;
    view = { x: px - (cx / r.width) * nw, y: py - (cy / r.height) * view.h * k, w: nw, h: view.h * k };
    apply();
  }
  if (vp && svg) {
    svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
    fit("width");
    if (!view) { view = { x: 0, y: 0, w: +svg.getAttribute("data-w"), h: +svg.getAttribute("data-h") }; }
    if (window.ResizeObserver) {
      var last = 0;
      new ResizeObserver(function () {
        var w = vp.getBoundingClientRect().width;
        if (w && Math.abs(w - last) > 2) { last = w; fit("width"); }
      }).observe(vp);
    }
    vp.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var r = vp.getBoundingClientRect();
      if (ev.ctrlKey || ev.metaKey) {
        zoom(Math.exp(ev.deltaY * 0.002), ev.clientX - r.left, ev.clientY - r.top);
      } else {
        var s = view.w / r.width;
        view.x += (ev.shiftKey ? ev.deltaY : ev.deltaX) * s;
        view.y += (ev.shiftKey ? 0 : ev.deltaY) * s;
        apply();
      }
    }, { passive: false });
    vp.addEventListener("pointerdown", function (ev) {
      if (ev.button !== 0) return;
      dragging = true; moved = false;
      start = { x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y };
      vp.classList.add("fxv-drag");
    });
    window.addEventListener("pointermove", function (ev) {
      if (!dragging) return;
      var dx = ev.clientX - start.x, dy = ev.clientY - start.y;
      if (Math.abs(dx) + Math.abs(dy) > 3) moved = true;
      if (!moved) return;
      var s = view.w / vp.getBoundingClientRect().width;
      view.x = start.vx - dx * s; view.y = start.vy - dy * s;
      apply();
    });
    window.addEventListener("pointerup", function () {
      if (!dragging) return;
      dragging = false; vp.classList.remove("fxv-drag");
      setTimeout(function () { moved = false; }, 0);
    });
    $$(".fxv-graph-tools [data-act]").forEach(function (b) {
      b.addEventListener("click", function (ev) {
        ev.stopPropagation();
        var a = b.getAttribute("data-act"), r = vp.getBoundingClientRect();
        if (a === "in") zoom(1 / 1.25, r.width / 2, r.height / 2);
        else if (a === "out") zoom(1.25, r.width / 2, r.height / 2);
        else fit(a);
      });
    });
  }
  $$(".fxv-srcleg span[data-s]").forEach(function (sp) {
    sp.addEventListener("mouseenter", function () {
      if (pinned) return;
      clear();
      var s = +sp.getAttribute("data-s");
      D.lines.forEach(function (ln, i) { if (ln.s === s) { mark(L[i], "fxv-hl-target"); markBox(lineBox[i]); } });
      if (insp) insp.innerHTML = '<div class="fxv-insp-main"><div class="fxv-insp-k">source line</div>' +
        '<div class="fxv-insp-what">every line recorded from it is highlighted</div></div><div>' + sourceHTML(s) + "</div>";
    });
  });
  function center(box) {
    if (!vp || !svg || !box || !view) return;
    var m = /translate\(([-\d.]+),([-\d.]+)\)/.exec(box.getAttribute("transform") || "");
    var r = box.querySelector("rect");
    if (!m || !r) return;
    var cx = +m[1] + (+r.getAttribute("width")) / 2, cy = +m[2] + (+r.getAttribute("height")) / 2;
    var inside = cx > view.x + view.w * 0.1 && cx < view.x + view.w * 0.9 &&
      cy > view.y + view.h * 0.1 && cy < view.y + view.h * 0.9;
    if (!inside) { view.x = cx - view.w / 2; view.y = cy - view.h / 2; apply(); }
  }
  function refit(h) {
    if (vp) { if (h) vp.style.setProperty("--fxv-graph-h", h + "px"); fit("width"); }
  }
  function pin(t, from) {  // focus and keep it (as a click does); pin(null) releases
    pinned = null;
    focus(t, from || "other");
    pinned = t;
    if (t) { if (t[0] === "b") showBlock(t[1]); else showLine(t[1]); }
  }
  root.fxv = { focus: focus, pin: pin, data: D, center: center, fit: refit, boxes: boxById };
}
