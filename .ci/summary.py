"""Print one summary line of JUnit XML reports (ctest's and pytest's): 'summary: N passed, N failed, N skipped'."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

passed = failed = skipped = 0
for report in sys.argv[1:]:
    path = Path(report)
    if not path.is_file():
        print(f"summary: {path} is missing: that suite did not run", file=sys.stderr)
        failed += 1
        continue
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed += 1
        elif "skipped" in tags or case.get("status") in ("notrun", "disabled"):
            skipped += 1
        else:
            passed += 1
print(f"summary: {passed} passed, {failed} failed, {skipped} skipped")
