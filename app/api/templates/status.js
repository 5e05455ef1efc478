(function(){
  var lost = document.getElementById("lost");
  var every = Number(document.body.dataset.refresh) || 5;
  var revision = null, pending = false, last = 0;
  function down(why){
    lost.textContent = "Lost the registry at " + new Date().toISOString() + " (" + why +
      "); the page below is from before. Retrying every " + every + " s.";
    lost.hidden = false;
  }
  async function refresh(){
    pending = false; last = Date.now();
    try {
      var r = await fetch(location.href, {credentials: "same-origin", cache: "no-store",
        signal: AbortSignal.timeout(4000)});
      if (!r.ok) throw new Error("the registry answered " + r.status);
      var doc = new DOMParser().parseFromString(await r.text(), "text/html");
      document.querySelector("main").replaceWith(doc.querySelector("main"));
      lost.hidden = true;
    } catch (e) { down(e.message); }
  }
  function changed(){
    if (pending) return;
    pending = true;
    setTimeout(refresh, Math.max(0, 1000 - (Date.now() - last)));
  }
  function silent(ms){
    return new Promise(function(_, no){
      setTimeout(function(){ no(new Error("no word for " + ms / 1000 + " s")); }, ms);
    });
  }
  async function follow(){
    var url = location.origin + "/tp-groups?watch=true" +
      (revision === null ? "" : "&revision=" + revision);
    try {
      var r = await fetch(url, {credentials: "same-origin", cache: "no-store"});
      if (r.status === 410) { revision = null; changed(); throw new Error("history compacted"); }
      if (!r.ok) throw new Error("the registry answered " + r.status);
      if (revision !== null || !lost.hidden) changed();
      var reader = r.body.getReader(), decoder = new TextDecoder(), text = "";
      while (true) {
        var got = await Promise.race([reader.read(), silent(20000)]);
        if (got.done) throw new Error("the registry ended the stream");
        text += decoder.decode(got.value, {stream: true});
        var lines = text.split("\n");
        text = lines.pop();
        for (var i = 0; i < lines.length; i++) {
          if (!lines[i]) continue;
          var line = JSON.parse(lines[i]);
          if (line.type === "ERROR") throw new Error(line.object.detail);
          revision = line.revision;
          if (line.type !== "BOOKMARK") changed();
        }
      }
    } catch (e) {
      down(e.message);
      setTimeout(follow, every * 1000);
    }
  }
  follow();
})();
