// Each figure of a page opens full size, in a new tab, on a click.
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll("article img")) {
    if (img.closest("a")) continue;
    const link = document.createElement("a");
    link.href = img.src;
    link.target = "_blank";
    link.title = "Open full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
});
