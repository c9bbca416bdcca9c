(function () {
  var form = document.getElementById("filters");
  if (!form) return;
  form.hidden = false;
  var cells = document.querySelectorAll("details.cell");
  var selects = form.querySelectorAll("select");
  function apply() {
    var shown = 0;
    cells.forEach(function (cell) {
      var match = true;
      selects.forEach(function (select) {
        if (select.value && cell.dataset[select.name] !== select.value) match = false;
      });
      cell.hidden = !match;
      if (match) shown += 1;
    });
    document.getElementById("shown").textContent = shown + " of " + cells.length + " shown";
  }
  selects.forEach(function (select) { select.addEventListener("change", apply); });
  apply();
})();
